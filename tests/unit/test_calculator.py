"""The calculator evaluates arithmetic from the syntax tree (never eval), refuses everything else, and
refuses huge results *before* computing them."""

import math
import time

import pytest

from areal_like.tools.calculator import MAX_INT_BITS, CalculatorError, CalculatorTool, evaluate, format_number
from areal_like.tools.config import build_config


@pytest.mark.parametrize("expr, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 // 2", -4), ("7 % 3", 1),
    ("2 ** 10", 1024), ("2 ** -2", 0.25), ("-3", -3), ("+3", 3), ("--3", 3), ("1.5e3", 1500.0),
    ("sqrt(16)", 4.0), ("abs(-2.5)", 2.5), ("round(3.14159, 2)", 3.14), ("round(2.6)", 3),
    ("min(3, 1, 2)", 1), ("max(3, 1, 2)", 3), ("log(e)", 1.0), ("log(8, 2)", 3.0), ("exp(0)", 1.0),
    ("sin(0)", 0.0), ("cos(pi)", -1.0), ("floor(2.7)", 2), ("ceil(2.1)", 3), ("log10(1000)", 3.0),
    ("10 ** 1000 // 10 ** 999", 10), ("2 ** 3 ** 2", 512),
])
def test_arithmetic(expr, value):
    got = evaluate(expr)
    assert got == pytest.approx(value) and type(got) is type(value)


@pytest.mark.parametrize("expr, kind, fragment", [
    ("1 / 0", "math_error", "division by zero"),
    ("5 // 0", "math_error", "division by zero"),
    ("5 % 0", "math_error", "division by zero"),
    ("0 ** -1", "math_error", "division by zero"),
    ("sqrt(-1)", "math_error", "math domain error"),
    ("log(0)", "math_error", "math domain error"),
    ("(-8) ** 0.5", "math_error", "complex"),
    ("2.0 ** 5000", "math_error", "too large"),
    ("exp(1000)", "math_error", "too large"),
    ("1e999", "math_error", "too large"),
    ("9 ** 9 ** 9", "refused", "too large"),
    ("2 ** (MAX + 1)".replace("MAX", str(MAX_INT_BITS)), "refused", "too large"),
    ("10 ** 1000 * 10 ** 1000", "refused", "too large"),
    ("-" * 400 + "1", "refused", "too complex"),
    ("1" * 2000, "refused", "too long"),
    ("__import__('os').system('echo pwned')", "bad_arguments", "calling an Attribute is not allowed"),
    ("__import__('os')", "bad_arguments", "unknown function '__import__'"),
    ("().__class__.__bases__", "bad_arguments", "Attribute is not allowed"),
    ("(1).real", "bad_arguments", "Attribute is not allowed"),
    ("[1, 2][0]", "bad_arguments", "not allowed"),
    ("'a' * 3", "bad_arguments", "only numbers"),
    ("True + 1", "bad_arguments", "only numbers"),
    ("1j * 1j", "bad_arguments", "only numbers"),
    ("x + 1", "bad_arguments", "unknown name 'x'"),
    ("eval('1')", "bad_arguments", "unknown function 'eval'"),
    ("lambda: 1", "bad_arguments", "Lambda is not allowed"),
    ("[i for i in range(10)]", "bad_arguments", "not allowed"),
    ("1 << 100000", "bad_arguments", "BinOp is not allowed"),
    ("1 if 1 else 2", "bad_arguments", "IfExp is not allowed"),
    ("1 < 2", "bad_arguments", "Compare is not allowed"),
    ("sqrt(x=4)", "bad_arguments", "positional arguments only"),
    ("sqrt()", "bad_arguments", "takes 1 argument"),
    ("round(2.5, 1.5)", "bad_arguments", "must be an integer"),
    ("1 +", "bad_arguments", "not a valid expression"),
    ("import os", "bad_arguments", "not a valid expression"),
])
def test_refusals_and_math_errors(expr, kind, fragment):
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError) as e:
        evaluate(expr, max_chars=1000)
    assert time.perf_counter() - t0 < 0.1  # refused before any large computation
    assert e.value.kind == kind
    assert fragment in str(e.value), str(e.value)


def test_largest_allowed_power_is_exact():
    assert evaluate("3 ** 2000") == 3 ** 2000  # ~3170 bits: under the limit


def test_format_number():
    assert format_number(10 ** 30) == "1" + "0" * 30
    assert format_number(0.1 + 0.2) == "0.3"
    assert format_number(2.0) == "2"
    assert format_number(math.pi, 4) == "3.142"


async def test_tool_observations():
    tool = CalculatorTool(build_config(CalculatorTool.Config, {"digits": 6}, "test"))
    assert (await tool.execute({"expression": "sqrt(2) * (3 + 4) ** 2"})).text == "69.2965"
    r = await tool.execute({"expression": "1/0"})
    assert (r.text, r.error) == ("Error: division by zero", "math_error")
    r = await tool.execute({"expression": "9**9**9"})
    assert r.error == "refused" and r.text.startswith("Error: the result of a power is too large")


def test_config_bounds():
    with pytest.raises(ValueError, match="digits=40"):
        build_config(CalculatorTool.Config, {"digits": 40}, "test")
