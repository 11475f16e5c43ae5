"""Tool config loading (every mistake names file, tool and key), schemas, and `ToolSet.call`'s contract:
it never raises — unknown tools, bad arguments, exceptions and hangs come back as error observations,
counted by outcome. Also the search tool over a tiny parquet corpus."""

import asyncio
import os
import tempfile
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_like.metrics import REGISTRY
from areal_like.tools import ToolResult, ToolSet
from areal_like.tools.base import check_arguments
from areal_like.tools.sandbox import SCRATCH_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _yaml(tmp_path, body: str, name: str = "tools.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _count(tool: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("areal_like_tool_calls_total", {"tool": tool, "outcome": outcome}) or 0.0


# ---- a user's tools, loaded by dotted path ------------------------------------------------------
USER_TOOLS = '''
import asyncio
from dataclasses import dataclass
from areal_like.tools import Tool, ToolResult

SCHEMA = {"type": "function", "function": {"name": "echo", "description": "echo",
          "parameters": {"type": "object", "properties": {"msg": {"type": "string"}, "n": {"type": "integer"}},
                         "required": ["msg"]}}}

class Echo(Tool):
    default_schema = SCHEMA
    async def execute(self, arguments, **kw):
        return ToolResult(f"{arguments['msg']}|{sorted(kw.items())}|{self.config}")

class Boom(Tool):
    default_schema = {**SCHEMA, "function": {**SCHEMA["function"], "name": "boom"}}
    async def execute(self, arguments, **kw):
        raise RuntimeError("kaput")

class Hang(Tool):
    default_schema = {**SCHEMA, "function": {**SCHEMA["function"], "name": "hang"}}
    call_timeout_s = 0.2
    async def execute(self, arguments, **kw):
        await asyncio.sleep(30)

class Wrong(Tool):
    default_schema = {**SCHEMA, "function": {**SCHEMA["function"], "name": "wrong"}}
    async def execute(self, arguments, **kw):
        return 42

class Long(Tool):
    default_schema = {**SCHEMA, "function": {**SCHEMA["function"], "name": "long"}}
    output_chars = 100
    async def execute(self, arguments, **kw):
        return ToolResult("a" * 500 + "END")

class NoSchema(Tool):
    async def execute(self, arguments, **kw):
        return ToolResult("x")

class NotATool:
    pass
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "user_tools_mod.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_tools_mod"


@pytest.fixture
def toolset(tmp_path, user_tools) -> ToolSet:
    path = _yaml(tmp_path, f"""
        tools:
          - class_name: {user_tools}.Echo
            config: {{greeting: hi}}
          - class_name: {user_tools}.Boom
          - class_name: {user_tools}.Hang
          - class_name: {user_tools}.Wrong
          - class_name: {user_tools}.Long
          - class_name: calculator
    """)
    return ToolSet.from_config(path)


# ---- config loading -----------------------------------------------------------------------------
def test_builtin_configs_in_the_repo_load():
    for name, tool in (("python.yaml", "python"), ("calculator.yaml", "calculator")):
        ts = ToolSet.from_config(os.path.join(REPO, "configs", "tools", name))
        assert ts.names == [tool]
    with pytest.raises(ValueError, match="search_corpus.parquet.*does not exist"):
        ToolSet.from_config(os.path.join(REPO, "configs", "tools", "search.yaml"))


def test_builtin_default_schemas(tmp_path):
    ts = ToolSet.from_config(_yaml(tmp_path, "tools:\n  - class_name: python\n  - class_name: calculator\n"))
    assert ts.names == ["python", "calculator"]
    schemas = ts.schemas()
    assert [s["function"]["name"] for s in schemas] == ["python", "calculator"]
    for s in schemas:
        assert s["type"] == "function"
        assert s["function"]["parameters"]["type"] == "object"
        assert s["function"]["description"]
    assert schemas[0]["function"]["parameters"]["required"] == ["code"]
    assert schemas[1]["function"]["parameters"]["required"] == ["expression"]


def test_schema_name_renames_a_builtin(tmp_path):
    path = _yaml(tmp_path, """
        tools:
          - class_name: python
            tool_schema:
              type: function
              function:
                name: code_interpreter
                description: run code
                parameters: {type: object, properties: {code: {type: string}}, required: [code]}
    """)
    ts = ToolSet.from_config(path)
    assert ts.names == ["code_interpreter"]
    assert ts.schemas()[0]["function"]["description"] == "run code"


@pytest.mark.parametrize("body, expected", [
    ("tools: [", ["not valid YAML"]),
    ("- class_name: python\n", ["top level must be a mapping with a `tools:` list"]),
    ("tools: []\n", ["`tools` is empty"]),
    ("tools:\n  - class_name: python\ntool: x\n", ["unknown top-level key", "'tool'"]),
    ("tools:\n  - python\n", ["tools[0] must be a mapping"]),
    ("tools:\n  - config: {}\n", ["tools[0].class_name is missing", "python, search, calculator"]),
    ("tools:\n  - class_name: python\n    confg: {}\n", ["tools[0]", "unknown key(s) ['confg']"]),
    ("tools:\n  - class_name: pyhton\n", ["tools[0]", "unknown tool class 'pyhton'", "python, search, calculator"]),
    ("tools:\n  - class_name: calculator\n  - class_name: python\n    config: {timout_s: 5}\n",
     ["tools[1] (python).config", "unknown key(s) ['timout_s']", "valid keys: timeout_s", "fix the spelling"]),
    ("tools:\n  - class_name: python\n    config: {timeout_s: five}\n",
     ["tools[0] (python).config.timeout_s must be a number", "'five'"]),
    ("tools:\n  - class_name: python\n    config: {network: 'no'}\n", ["config.network must be true/false"]),
    ("tools:\n  - class_name: python\n    config: {memory_mb: 1.5}\n", ["config.memory_mb must be an integer"]),
    ("tools:\n  - class_name: python\n    config: {timeout_s: -1}\n", ["tools[0] (python)", "timeout_s=-1", "> 0"]),
    ("tools:\n  - class_name: python\n    config: [1, 2]\n", ["config must be a mapping"]),
    ("tools:\n  - class_name: search\n    config: {top_k: 2}\n", ["tools[0] (search).config", "missing required",
                                                                  "corpus"]),
    ("tools:\n  - class_name: python\n    tool_schema: {type: function, function: {name: py, parameters: "
     "{type: object, properties: {src: {type: string}}, required: [src]}}}\n",
     ["tools[0] (python).tool_schema", "lacks ['code']"]),
    ("tools:\n  - class_name: python\n    tool_schema: {type: function, function: {name: 'bad name'}}\n",
     ["tool_schema.function.name must be"]),
    ("tools:\n  - class_name: python\n    tool_schema: {type: function, function: {name: p, parameters: "
     "{type: object, properties: {code: {}}, required: [cod]}}}\n", ["required must list argument names"]),
    ("tools:\n  - class_name: python\n  - class_name: python\n", ["tools[1] and tools[0] are both named 'python'"]),
    ("tools:\n  - class_name: os.path.join\n", ["tools[0]", "not a subclass of areal_like.tools.Tool"]),
    ("tools:\n  - class_name: no_such_pkg_zz.Tool\n", ["tools[0]", "cannot import no_such_pkg_zz"]),
])
def test_config_errors_name_file_tool_and_key(tmp_path, body, expected):
    path = _yaml(tmp_path, body)
    with pytest.raises(ValueError) as e:
        ToolSet.from_config(path)
    msg = str(e.value)
    assert path in msg
    for part in expected:
        assert part in msg, msg


def test_missing_config_file_says_what_to_set(tmp_path):
    with pytest.raises(ValueError, match="does not exist: set rollout.tools_config"):
        ToolSet.from_config(str(tmp_path / "nope.yaml"))


def test_user_tool_without_schema_needs_one(tmp_path, user_tools):
    path = _yaml(tmp_path, f"tools:\n  - class_name: {user_tools}.NoSchema\n")
    with pytest.raises(ValueError, match=r"tools\[0\].*tool_schema is missing"):
        ToolSet.from_config(path)
    path = _yaml(tmp_path, f"tools:\n  - class_name: {user_tools}.NotATool\n", "b.yaml")
    with pytest.raises(ValueError, match="not a subclass"):
        ToolSet.from_config(path)


# ---- ToolSet.call never raises ------------------------------------------------------------------
async def test_call_ok_and_tools_kwargs_merge(toolset):
    r = await toolset.call("echo", {"msg": "hello"})
    assert r == ToolResult("hello|[]|{'greeting': 'hi'}", None, r.metrics)
    assert r.metrics["tool_seconds"] >= 0
    kwargs = {"echo": {"create_kwargs": {"a": 1, "b": 1}, "execute_kwargs": {"b": 2}}, "other": {"x": 1}}
    r = await toolset.call("echo", '{"msg": "hi"}', tools_kwargs=kwargs)
    assert r.text.startswith("hi|[('a', 1), ('b', 2)]")  # execute_kwargs win over create_kwargs


async def test_unknown_tool(toolset):
    before = _count("_unknown", "unknown_tool")
    r = await toolset.call("nosuch", {"msg": "x"})
    assert r.error == "unknown_tool"
    assert r.text.startswith("Error: unknown tool 'nosuch'") and "echo" in r.text
    assert _count("_unknown", "unknown_tool") == before + 1


@pytest.mark.parametrize("arguments, fragment", [
    ('{"msg": ', "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    (42, "must be a JSON object, got int"),
    ({}, "missing required argument(s): msg"),
    ("", "missing required argument(s): msg"),
    ({"msg": 3}, "argument 'msg' must be of type string, got int"),
    ({"msg": "x", "n": True}, "argument 'n' must be of type integer, got bool"),
])
async def test_bad_arguments(toolset, arguments, fragment):
    before = _count("echo", "bad_arguments")
    r = await toolset.call("echo", arguments)
    assert r.error == "bad_arguments"
    assert r.text.startswith("Error") and fragment in r.text, r.text
    assert _count("echo", "bad_arguments") == before + 1


async def test_exception_timeout_wrong_return_and_truncation(toolset):
    r = await toolset.call("boom", {"msg": "x"})
    assert (r.error, r.text) == ("exception", "Error: boom raised RuntimeError: kaput")
    before = _count("hang", "timeout")
    r = await toolset.call("hang", {"msg": "x"})
    assert r.error == "timeout" and "0.2s" in r.text
    assert _count("hang", "timeout") == before + 1
    r = await toolset.call("wrong", {"msg": "x"})
    assert r.error == "exception" and "not a ToolResult" in r.text
    r = await toolset.call("long", {"msg": "x"})
    assert r.error is None and len(r.text) < 200 and "truncated" in r.text and r.text.endswith("END")


async def test_malformed_tools_kwargs_is_an_observation(toolset):
    r = await toolset.call("echo", {"msg": "x"}, tools_kwargs={"echo": {"execute_kwargs": [1]}})
    assert r.error == "bad_tools_kwargs" and "execute_kwargs" in r.text
    r = await toolset.call("echo", {"msg": "x"}, tools_kwargs=["nope"])
    assert r.error == "bad_tools_kwargs"


async def test_cancellation_propagates(toolset):
    task = asyncio.ensure_future(toolset.call("hang", {"msg": "x"}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_close_closes_every_tool(toolset):
    await toolset.close()  # default close: nothing to release, must not raise


def test_check_arguments_enum_and_additional_properties():
    params = {"type": "object", "properties": {"mode": {"type": "string", "enum": ["a", "b"]}},
              "additionalProperties": False}
    assert check_arguments(params, {"mode": "a"}) is None
    assert "must be one of" in check_arguments(params, {"mode": "c"})
    assert "unexpected argument(s): x" in check_arguments(params, {"x": 1})
    assert check_arguments({"type": "object", "properties": {"v": {"type": ["number", "null"]}}}, {"v": None}) is None


# ---- python tool through the ToolSet (real sandbox processes) ----------------------------------
async def test_python_tool_output_error_and_row_kwargs(tmp_path):
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(SCRATCH_PREFIX)}
    ts = ToolSet.from_config(_yaml(tmp_path, "tools:\n  - class_name: python\n    config: {output_chars: 300}\n"))
    r = await ts.call("python", {"code": "print(sum(range(10)))"})
    assert (r.error, r.text) == (None, "45\n")
    r = await ts.call("python", {"code": "pass"})
    assert r.error is None and r.text.startswith("(no output")
    r = await ts.call("python", {"code": "print('before')\n1/0"})
    assert r.error == "exception"
    assert r.text.startswith("before\nError (exception)") and "ZeroDivisionError" in r.text
    r = await ts.call("python", {"code": "print(input(), open('x.txt').read())"},
                      tools_kwargs={"python": {"execute_kwargs": {"stdin": "in", "files": {"x.txt": "file"}}}})
    assert (r.error, r.text) == (None, "in file\n")
    r = await ts.call("python", {"code": "print('z' * 5000)"})
    assert r.error is None and "truncated" in r.text and len(r.text) <= 400
    after = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(SCRATCH_PREFIX)}
    assert after - before == set(), "a scratch directory was left behind"


# ---- search -------------------------------------------------------------------------------------
CORPUS = [
    ("d1", "Paris is the capital and most populous city of France."),
    ("d2", "Berlin is the capital of Germany and its largest city."),
    ("d3", "The Python programming language was created by Guido van Rossum. " * 20),
    ("d4", "Photosynthesis converts light energy into chemical energy in plants."),
]


def _corpus(tmp_path, rows=CORPUS, names=("id", "text")) -> str:
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({names[0]: [r[0] for r in rows], names[1]: [r[1] for r in rows]}), path)
    return str(path)


def _search_toolset(tmp_path, corpus: str, top_k: int = 2) -> ToolSet:
    return ToolSet.from_config(_yaml(tmp_path, f"""
        tools:
          - class_name: search
            config: {{corpus: {corpus}, top_k: {top_k}, max_passage_chars: 80}}
    """))


async def test_search_returns_numbered_passages(tmp_path):
    ts = _search_toolset(tmp_path, _corpus(tmp_path))
    r = await ts.call("search", {"query": "capital of France"})
    assert r.error is None
    lines = r.text.splitlines()
    assert lines[0] == "Doc 1 (id=d1): Paris is the capital and most populous city of France."
    assert lines[1].startswith("Doc 2 (id=d2): Berlin")
    assert len(lines) == 2  # top_k
    r = await ts.call("search", {"query": "who created python"})
    assert r.text.startswith("Doc 1 (id=d3): The Python programming language")
    assert r.text.endswith("…") and len(r.text) < 120  # the passage is cut to max_passage_chars
    r = await ts.call("search", {"query": "zzzz qqqq"})
    assert r.error is None and r.text.startswith("No results")
    r = await ts.call("search", {"query": "  "})
    assert r.error == "bad_arguments"


def test_search_corpus_errors_name_file_and_columns(tmp_path):
    bad = _corpus(tmp_path, names=("doc_id", "text"))
    with pytest.raises(ValueError) as e:
        _search_toolset(tmp_path, bad)
    msg = str(e.value)
    assert bad in msg and "lacks column(s) id" in msg and "found: doc_id, text" in msg
    missing = str(tmp_path / "none.parquet")
    with pytest.raises(ValueError, match="none.parquet.*does not exist"):
        _search_toolset(tmp_path, missing)
    notparquet = tmp_path / "x.parquet"
    notparquet.write_text("hello")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        _search_toolset(tmp_path, str(notparquet))
    with pytest.raises(ValueError, match="top_k=0 must be > 0"):
        _search_toolset(tmp_path, _corpus(tmp_path), top_k=0)


# ---- sandbox output capture: the truncation note counts the bytes cut (issue 24 item 11) ----------
def _captured(data: bytes, cap: int, complete: bool = True):
    from areal_like.tools.sandbox import _Capture

    async def go():
        c = _Capture(cap)
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        await c.drain(reader)
        c.complete = complete
        return c
    return asyncio.run(go())


@pytest.mark.parametrize("keep", ["middle", "tail"])
def test_capture_note_counts_bytes_exactly_with_multibyte_text(keep):
    """Every byte is either shown or counted in the note, also when the cut splits a multi-byte char."""
    import re
    data = "é€𝄞x".encode() * 5000  # 10 bytes per 4 chars
    for cap in (97, 1 << 20):  # head/tail kept while reading, or all of it
        c = _captured(data, cap)
        text = c.render(300, keep)
        assert len(text) <= 300
        m = re.search(r"\n?\.\.\.\[(\d+) bytes truncated: the output was (\d+) bytes[^\]]*\]\.\.\.\n", text)
        assert m and int(m.group(2)) == len(data)
        shown = text.replace(m.group(0), "")
        head, _, tail = text.partition(m.group(0))
        # only a char split by a cut is replaced, at the cut
        assert "\ufffd" not in head.rstrip("\n").rstrip("\ufffd") and "\ufffd" not in tail.lstrip("\ufffd")
        # whole chars shown + the bytes of split chars at the edges (1-3 each, shown as U+FFFD) + the cut
        whole_chars = len(shown.replace("\ufffd", "").encode())
        split = shown.count("\ufffd")
        assert whole_chars + split <= len(data) - int(m.group(1)) <= whole_chars + 3 * split
    # ASCII: exact
    c = _captured(b"z" * 100_000, 97)
    text = c.render(300, keep)
    m = re.search(r"\.\.\.\[(\d+) bytes truncated", text)
    assert int(m.group(1)) == 100_000 - text.count("z")


def test_capture_says_at_least_when_not_read_to_the_end():
    c = _captured(b"y" * 10_000, 256, complete=False)
    assert "[at least 9" in c.render(200) and "the output was at least 10000 bytes" in c.render(200)
    c = _captured(b"short\n", 256)
    assert c.render(200) == "short\n"


def test_a_fork_bomb_is_a_process_limit_whatever_line_its_processes_wrote_last():
    """The fork bomb's processes share one stderr: the tail may end inside another process's traceback
    (CI saw 'exception' here). The classification reads the whole tail."""
    from areal_like.tools.sandbox import _classify

    tail = ('Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n'
            'BlockingIOError: [Errno 11] Resource temporarily unavailable\n'
            'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n    os.fork()\n')
    lim = {"timeout_s": 3, "cpu_s": 3, "memory_mb": 512, "file_mb": 16, "max_procs": 16}
    status = 1 << 8  # exit code 1
    assert _classify({"status": status}, False, tail, lim)[0] == "process_limit"
    assert _classify({"status": status}, False, "ValueError: nope\n", lim)[0] == "exception"
