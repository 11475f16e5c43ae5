"""Issue 24 against a real agent proxy on loopback, a real embedded generation server and raw HTTP
clients: a 50 MB agent request (item 6) and a streamed reply the agent disconnected from (item 11).

Item 6's probe: a 50 MB body drove the rollout worker to 17.7 GB and growing (the proxy read it
whole, then tokenized it), and a 2 MB one held every other agent ~2.4 s behind the one tokenizer
thread. Here the proxy runs in its own process, as in the rollout worker, so its memory peak
(VmHWM) is its own; its address space is capped a few GB above its start so that a proxy without
the bound fails fast instead of taking the test machine down.
"""

import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import threading

import aiohttp
import pytest

from _agent_server import agent_model_dir, server  # noqa: F401 (fixtures)

from areal_like.agent import AgentProxy
from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.engine.client import GenerationClient

pytestmark = pytest.mark.integration

MB = 1 << 20
GEN = GenerationConfig(n=2, max_new_tokens=10, temperature=1.0)

PROXY_SCRIPT = r"""
import asyncio, json, resource, sys
from transformers import AutoTokenizer
from areal_like.agent import AgentProxy
from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.engine.client import GenerationClient


def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


async def main(url, model):
    tok = AutoTokenizer.from_pretrained(model)
    gen = GenerationConfig(n=2, max_new_tokens=10, temperature=1.0)
    mt = MultiTurnConfig(max_assistant_turns=3, max_completions_per_episode=50)
    async with GenerationClient([url], health_interval_s=None) as client:
        async with AgentProxy(client, tok, gen, mt, seed=1, max_context_len=512) as proxy:
            big, small = proxy.open_session("big", 0), proxy.open_session("small", 0)
            # a safety net, not the assertion: without the bound the proxy grows by GBs
            resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize") + 3 * 2**30, resource.RLIM_INFINITY))
            print(json.dumps({"url": proxy.base_url, "big": big.api_key, "small": small.api_key,
                              "limit": getattr(proxy, "max_request_bytes", None)}), flush=True)
            loop = asyncio.get_running_loop()
            while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip() == "report":
                print(json.dumps({"big": len(big.completions), "small": len(small.completions)}), flush=True)


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def chat(url: str, key: str, content: str = "hi") -> tuple[int, dict]:
    """One small chat request, as another agent makes it (its own connection)."""

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"messages": [{"role": "user", "content": content}], "max_tokens": 3},
                              timeout=aiohttp.ClientTimeout(total=300)) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


class BigUpload:
    """One agent's 50 MB chat request over a raw socket, sent by a thread: `Content-Length` declared
    or chunked. `pause_after` bytes of body are sent, then it waits for `resume`."""

    def __init__(self, url: str, key: str, *, size: int, chunked: bool, pause_after: int):
        host, port = url.split("//")[1].split("/")[0].split(":")
        self.sock = socket.create_connection((host, int(port)))
        head = b'{"messages": [{"role": "user", "content": "'
        tail = b'"}]}'
        filler = b"hello world, please tokenize me " * (64 * 1024 // 32)  # 64 KiB of text
        n = (size - len(head) - len(tail)) // len(filler)
        self.size = len(head) + n * len(filler) + len(tail)
        self.pieces = [head] + [filler] * n + [tail]
        headers = [b"POST /v1/chat/completions HTTP/1.1", b"Host: " + host.encode(),
                   b"Authorization: Bearer " + key.encode(), b"Content-Type: application/json"]
        headers.append(b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % self.size)
        self.chunked, self.pause_after = chunked, pause_after
        self.paused, self.resume, self.done = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.sock.sendall(b"\r\n".join(headers) + b"\r\n\r\n")
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self):
        sent = 0
        try:
            for p in self.pieces:
                self.sock.sendall(b"%x\r\n%s\r\n" % (len(p), p) if self.chunked else p)
                sent += len(p)
                if sent >= self.pause_after and not self.paused.is_set():
                    self.paused.set()
                    self.resume.wait()
            if self.chunked:
                self.sock.sendall(b"0\r\n\r\n")
        except OSError as e:  # the proxy closed the connection on us: its answer is what counts
            self.error = e
        finally:
            self.paused.set()
            self.done.set()

    def answered(self) -> bool:
        """Whether the proxy's answer is already waiting on the socket (without waiting for it)."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def response(self) -> tuple[int, dict]:
        self.sock.settimeout(300)
        data = b""
        while b"\r\n\r\n" not in data:
            got = self.sock.recv(65536)
            assert got, f"the proxy closed the connection without an answer (send error: {self.error!r})"
            data += got
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        while len(rest) < length:
            got = self.sock.recv(65536)
            assert got, "the proxy closed the connection mid-answer"
            rest += got
        return status, json.loads(rest[:length])

    def close(self):
        self.resume.set()
        self.sock.close()


def test_a_50mb_agent_request_costs_the_worker_nothing_and_other_agents_no_wait(server, agent_model_dir):
    """Item 6: a 50 MB chat body (Content-Length, then chunked) is a 413 naming
    rollout.multi_turn.max_request_bytes_per_token, answered before its body is consumed; the proxy
    process's memory peak grows < 100 MB; another agent's requests complete while the big one is
    being sent and right after it, and the big one records nothing."""
    proc = subprocess.Popen([sys.executable, "-c", PROXY_SCRIPT, server.url, agent_model_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        url = info["url"]
        assert chat(url, info["small"])[0] == 200  # warm: tokenizer, template, generation path
        peak0 = vm_kb(proc.pid, "VmHWM")
        for chunked in (False, True):
            big = BigUpload(url, info["big"], size=50 * MB, chunked=chunked, pause_after=4 * MB)
            try:
                assert big.paused.wait(300)
                # another agent, while 4 MB of the big request are sent and the rest is pending
                st, body = chat(url, info["small"])
                assert st == 200 and body["choices"][0]["message"]["role"] == "assistant", body
                big.resume.set()
                assert big.done.wait(300)
                # the whole 50 MB are sent: its answer was already there before anyone waited for it ...
                assert big.answered(), "the 50 MB request was not answered until after its whole body was taken in"
                # ... and another agent is served at once, not behind a tokenizer busy with 50 MB
                st, body = chat(url, info["small"], "and again")
                assert st == 200, body
                st, err = big.response()
            finally:
                big.close()
            assert st == 413, (chunked, st, err)
            assert "rollout.multi_turn.max_request_bytes_per_token" in err["error"]["message"], err
            assert err["error"]["code"] == "request_too_large"
        grown_mb = (vm_kb(proc.pid, "VmHWM") - peak0) / 1024
        assert grown_mb < 100, f"the proxy's memory peak grew {grown_mb:.0f} MB for one 50 MB request"
        proc.stdin.write("report\n")
        proc.stdin.flush()
        counts = json.loads(proc.stdout.readline())
        assert counts == {"big": 0, "small": 5}, counts
        assert info["limit"] < MB  # 512 tokens of context: the bound is far below the 50 MB the probe sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


async def test_chat_text_longer_than_the_context_is_refused_before_tokenizing(server, agent_model_dir):
    """A body under the byte bound whose text cannot fit the context (512 tokens × 32 chars) is a 400
    context_length_exceeded naming the key; the tokenizer never sees it."""
    from transformers import AutoTokenizer

    class CountingTokenizer:
        def __init__(self, tok):
            self.tok, self.rendered = tok, []

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def apply_chat_template(self, messages, **kw):
            self.rendered.append(sum(len(m["content"]) for m in messages))
            return self.tok.apply_chat_template(messages, **kw)

    tok = CountingTokenizer(AutoTokenizer.from_pretrained(agent_model_dir))
    async with GenerationClient([server.url], health_interval_s=None) as client:
        async with AgentProxy(client, tok, GEN, MultiTurnConfig(max_assistant_turns=3), max_context_len=512) as proxy:
            s = proxy.open_session("g", 0)
            text = "x" * (512 * 32 + 1000)  # < max_request_bytes (it has 64 KiB of slack), > max_prompt_chars
            async with aiohttp.ClientSession() as http:
                async with http.post(proxy.base_url + "/chat/completions",
                                     headers={"Authorization": f"Bearer {s.api_key}"},
                                     json={"messages": [{"role": "user", "content": text}]}) as r:
                    st, body = r.status, await r.json()
            assert st == 400 and body["error"]["code"] == "context_length_exceeded", body
            assert "rollout.multi_turn.max_request_bytes_per_token" in body["error"]["message"]
            assert tok.rendered == [] and s.completions == [] and s.admitted == 0


class GatedClient(GenerationClient):
    """The real client; each generation waits for `gate` (so the test can disconnect mid-request)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.entered, self.gate, self.finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def generate(self, input_ids, **kw):
        self.entered.set()
        await self.gate.wait()
        try:
            return await super().generate(input_ids, **kw)
        finally:
            self.finished.set()


async def _stream_request(proxy: AgentProxy, key: str, path: str, body: dict):
    host, port = proxy.host, proxy.port
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST /v1%s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), host.encode(), key.encode(), len(data), data))
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("path,body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/completions", {"prompt": "ab", "max_tokens": 4}),
], ids=["chat", "completions"])
async def test_a_streamed_reply_the_agent_disconnected_from_is_not_trained(server, agent_model_dir, path, body):
    """Item 11: the agent sends stream=true and closes its connection while the completion is generating;
    the completion is not recorded (so not exported as a trajectory) and its admission is given back.
    The same request read to its end is recorded (the control)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    async with GatedClient([server.url], health_interval_s=None) as client:
        async with AgentProxy(client, tok, GEN, MultiTurnConfig(max_assistant_turns=3), seed=1,
                              max_context_len=512) as proxy:
            s = proxy.open_session("g", 0)
            # 1. disconnect mid-stream: the proxy holds the request (generating) when the agent leaves
            reader, writer = await _stream_request(proxy, s.api_key, path, body)
            await asyncio.wait_for(client.entered.wait(), 60)
            writer.close()
            await writer.wait_closed()
            def gone():  # the proxy has seen the agent leave: its connection has no transport any more
                return all(h.transport is None for h in proxy._runner.server.connections)

            for _ in range(600):
                if gone():
                    break
                await asyncio.sleep(0.05)
            assert gone()
            client.gate.set()  # the generation completes after the agent left
            await asyncio.wait_for(client.finished.wait(), 60)
            for _ in range(600):
                if s.admitted == 0 and not s.inflight:
                    break
                await asyncio.sleep(0.05)
            assert s.completions == [], "a reply the agent disconnected from was recorded for training"
            assert s.admitted == 0
            assert proxy.session_trajectories(s, group_id="g", prompt_id="p", index=0, reward=1.0) == []
            # 2. the control: the same streamed request read to its end is recorded
            reader, writer = await _stream_request(proxy, s.api_key, path, body)
            raw = b""
            while b"data: [DONE]" not in raw:
                got = await asyncio.wait_for(reader.read(65536), 60)
                assert got, raw
                raw += got
            writer.close()
            assert raw.startswith(b"HTTP/1.1 200")
            for _ in range(600):
                if s.completions:
                    break
                await asyncio.sleep(0.05)
            assert len(s.completions) == 1 and s.admitted == 1
            (traj,) = proxy.session_trajectories(s, group_id="g", prompt_id="p", index=0, reward=1.0)
            assert traj.reward == 1.0


async def test_a_large_request_being_tokenized_does_not_queue_other_agents(server, agent_model_dir):
    """Item 6 (the 2 MB probe): while one agent's large request (over 64 KiB, under the bound) is in the
    tokenizer, another agent's small request is tokenized, generated and answered: the large one has
    its own tokenizer lane. The large tokenization is held open by the test until the small reply is in."""
    import copy
    import threading

    from transformers import AutoTokenizer

    class HeldTokenizer:
        """The real tokenizer; rendering a text over 64 KiB waits for `release` (shared by copies)."""

        def __init__(self, tok, entered, release):
            self.tok, self.entered, self.release = tok, entered, release

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def __deepcopy__(self, memo):
            return HeldTokenizer(copy.deepcopy(self.tok, memo), self.entered, self.release)

        def apply_chat_template(self, messages, **kw):
            if sum(len(m["content"]) for m in messages) > 64 * 1024:
                self.entered.set()
                assert self.release.wait(300)
            return self.tok.apply_chat_template(messages, **kw)

    entered, release = threading.Event(), threading.Event()
    tok = HeldTokenizer(AutoTokenizer.from_pretrained(agent_model_dir), entered, release)
    async with GenerationClient([server.url], health_interval_s=None) as client:
        async with AgentProxy(client, tok, GEN, MultiTurnConfig(max_assistant_turns=3), max_context_len=4096) as proxy:
            big_s, small_s = proxy.open_session("big", 0), proxy.open_session("small", 0)
            assert 100 * 1024 < proxy.max_request_bytes

            async def post(s, content):
                async with aiohttp.ClientSession() as http:
                    async with http.post(proxy.base_url + "/chat/completions",
                                         headers={"Authorization": f"Bearer {s.api_key}"},
                                         json={"messages": [{"role": "user", "content": content}], "max_tokens": 3},
                                         timeout=aiohttp.ClientTimeout(total=600)) as r:
                        return r.status, await r.json()

            big = asyncio.create_task(post(big_s, "hello world " * (100 * 1024 // 12)))
            try:
                assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 300)
                small = asyncio.create_task(post(small_s, "hi"))
                done, _ = await asyncio.wait({small, big}, timeout=300, return_when=asyncio.FIRST_COMPLETED)
                assert small in done and big not in done, "the small request waited behind the large one's tokenization"
                st, body = small.result()
                assert st == 200 and len(small_s.completions) == 1, body
            finally:
                release.set()
            st, body = await big
            assert st == 400 and body["error"]["code"] == "context_length_exceeded", body  # ~25k tokens > 4096


BIG_AGENT = '''
import json
import aiohttp
import openai


class BigRequestAgent:
    """Sends one oversized chat request first (64 KiB + 16 bytes per token of context), notes the answer
    in {log!r}, then makes one ordinary completion."""

    async def run(self, data, *, base_url, api_key, model, **kwargs):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
        try:
            ctx = (await client.models.list()).data[0].model_extra["max_model_len"]
            async with aiohttp.ClientSession() as s:
                async with s.post(base_url + "/chat/completions", headers={{"Authorization": "Bearer " + api_key}},
                                  json={{"messages": [{{"role": "user", "content": "x" * (65536 + 16 * ctx)}}]}}) as r:
                    answer = {{"status": r.status, "ctx": ctx, **(await r.json(content_type=None))["error"]}}
            with open({log!r}, "a") as f:
                f.write(json.dumps(answer) + "\\n")
            await client.chat.completions.create(model=model, max_tokens=4, messages=[{{"role": "user", "content": "hi"}}])
        finally:
            await client.close()
        return 1.0
'''


def test_the_request_bound_is_read_by_launcher_run(tmp_path):
    """Item 6 through `launcher run`: rollout.multi_turn.max_request_bytes_per_token reaches the rollout
    worker's proxy. With 1 byte per token (480 tokens of context: a 66,016-byte bound) an agent's 73 KB
    request is a 413 naming the key; with the default 32 the same request passes the byte bound."""
    from conftest import launcher_cli

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = tmp_path / "data"
    subprocess.run([sys.executable, os.path.join(root, "examples", "openai_agent", "build_data.py"), "--out", str(data),
                    "--n", "32"], check=True, capture_output=True)
    log = tmp_path / "answers.jsonl"
    agent = tmp_path / "big_agent.py"
    agent.write_text(BIG_AGENT.format(log=str(log)))
    rc, out = launcher_cli("run", "--config", "examples/openai_agent/config.yaml", "--run-dir", str(tmp_path / "run"),
                           f"data.train_files=[{data}/train.parquet]", "train.total_steps=1", "generation.n=2",
                           "train.batch_size=2", "metrics.prometheus=false", f"rollout.workflow={agent}:BigRequestAgent",
                           "rollout.multi_turn.max_request_bytes_per_token=1")
    assert rc == 0, out[-3000:]
    answers = [json.loads(line) for line in log.read_text().splitlines()]
    assert answers and all(a["status"] == 413 and a["code"] == "request_too_large" for a in answers), answers[:3]
    assert all("rollout.multi_turn.max_request_bytes_per_token (1)" in a["message"] for a in answers), answers[0]
    assert answers[0]["ctx"] == 480
