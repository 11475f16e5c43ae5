"""`calculator`: arithmetic on the model's expression, by walking its `ast` — never `eval`.

Allowed: numbers, + - * / // % ** (binary and unary), parentheses, the functions in `FUNCTIONS` and the
constants `pi`, `e`. Anything else (names, attributes, subscripts, strings, lambdas, comprehensions…)
is refused by node type, so there is nothing to escape to. The cost is bounded before it is paid: the
expression's length and node count are capped, and an integer result may not exceed `MAX_INT_BITS`
(checked *before* a power or product is computed, so `9**9**9` is refused in microseconds instead of
running for hours).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

from areal_like.tools.base import Tool, ToolResult

MAX_INT_BITS = 4000
"""Largest integer result, in bits (~1200 decimal digits; Python's str(int) limit is 4300 digits)."""
MAX_NODES = 300
"""Largest expression, in AST nodes."""

FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {  # name → (function, min args, max args)
    "sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (round, 1, 2),
    "min": (min, 1, 64), "max": (max, 1, 64),
    "log": (math.log, 1, 2), "log2": (math.log2, 1, 1), "log10": (math.log10, 1, 1), "exp": (math.exp, 1, 1),
    "sin": (math.sin, 1, 1), "cos": (math.cos, 1, 1), "tan": (math.tan, 1, 1),
    "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1),
}
CONSTANTS = {"pi": math.pi, "e": math.e}

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression we refuse or cannot evaluate; the message is shown to the model. `kind` is the
    ToolResult error: bad_arguments (not an expression we accept), refused (too large or complex),
    math_error (division by zero, outside a function's domain)."""

    def __init__(self, message: str, kind: str = "bad_arguments"):
        super().__init__(message)
        self.kind = kind


def _bits(x: int | float) -> float:
    """log2 of |x| (0 for |x| < 1): an estimate of an integer's size in bits, floats included."""
    if isinstance(x, int):
        return float(abs(x).bit_length())
    ax = abs(x)
    return math.log2(ax) if ax >= 1 and math.isfinite(ax) else 0.0


def _check(x: Any) -> int | float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise CalculatorError(f"the result is not a real number ({type(x).__name__})")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"the result is too large (over {MAX_INT_BITS} bits)", "refused")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is too large (overflow) or not a number", "math_error")
    return x


def _power(base: int | float, exp: int | float) -> int | float:
    # only int ** positive int is expensive (exact big integers); float powers overflow at once
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if exp * math.log2(abs(base)) > MAX_INT_BITS:
            raise CalculatorError(f"the result of a power is too large (over {MAX_INT_BITS} bits)", "refused")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero (0 to a negative power)", "math_error")
    result = base ** exp
    if isinstance(result, complex):
        raise CalculatorError("the result is a complex number (a negative number to a fractional power)",
                              "math_error")
    return result


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}: only {', '.join(CONSTANTS)} and the functions "
                              f"{', '.join(FUNCTIONS)} are allowed")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_INT_BITS + 1:
            raise CalculatorError(f"the result of a product is too large (over {MAX_INT_BITS} bits)", "refused")
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):  # e.g. x.method(): never resolve attributes
            raise CalculatorError(f"calling an {type(node.func).__name__} is not allowed: only the functions "
                                  f"{', '.join(FUNCTIONS)}")
        if node.func.id not in FUNCTIONS:
            raise CalculatorError(f"unknown function {node.func.id!r}: allowed are {', '.join(FUNCTIONS)}")
        fn, lo, hi = FUNCTIONS[node.func.id]
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{node.func.id}() takes plain positional arguments only")
        if not lo <= len(node.args) <= hi:
            raise CalculatorError(f"{node.func.id}() takes {lo}" + (f" to {hi}" if hi != lo else "")
                                  + f" argument(s), got {len(node.args)}")
        args = [_eval(a) for a in node.args]
        if node.func.id == "round" and len(args) == 2 and not isinstance(args[1], int):
            raise CalculatorError("round()'s second argument must be an integer")
        return _check(fn(*args))
    raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % **, parentheses "
                          "and the listed functions")


def evaluate(expression: str, max_chars: int = 1000) -> int | float:
    """The value of `expression`, or CalculatorError saying why not."""
    if len(expression) > max_chars:
        raise CalculatorError(f"the expression is too long ({len(expression)} chars, limit {max_chars})", "refused")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression ({type(e).__name__}: "
                              f"{getattr(e, 'msg', None) or e})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression is too complex (over {MAX_NODES} parts)", "refused")
    try:
        return _eval(tree.body)
    except CalculatorError:
        raise
    except ZeroDivisionError:
        raise CalculatorError("division by zero", "math_error") from None
    except OverflowError:
        raise CalculatorError("the result is too large (overflow)", "math_error") from None
    except (ValueError, TypeError) as e:
        raise CalculatorError(f"math error: {e}", "math_error") from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply", "refused") from None


def format_number(x: int | float, digits: int = 12) -> str:
    """Integers exactly; floats to `digits` significant digits (0.1 + 0.2 → 0.3)."""
    if isinstance(x, int):
        return str(x)
    return format(x, f".{digits}g")


@dataclass(frozen=True)
class CalculatorToolConfig:
    max_chars: int = 1000
    digits: int = 12

    def __post_init__(self) -> None:
        if self.max_chars <= 0:
            raise ValueError(f"max_chars={self.max_chars} must be > 0")
        if not 1 <= self.digits <= 17:
            raise ValueError(f"digits={self.digits} must be between 1 and 17 (a float holds ~17)")


class CalculatorTool(Tool):
    Config = CalculatorToolConfig
    required_arguments = ("expression",)
    call_timeout_s = 5.0
    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": ("Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, and "
                            "sqrt, abs, round, min, max, log, log2, log10, exp, sin, cos, tan, floor, ceil, "
                            "pi, e. Example: sqrt(2) * (3 + 4) ** 2"),
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, config: CalculatorToolConfig, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self.cfg = config

    async def execute(self, arguments: dict, **tools_kwargs: Any) -> ToolResult:
        expression = arguments["expression"]
        try:
            value = evaluate(str(expression), self.cfg.max_chars)
        except CalculatorError as e:
            return ToolResult(f"Error: {e}", error=e.kind)
        return ToolResult(format_number(value, self.cfg.digits))
