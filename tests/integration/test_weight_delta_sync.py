"""Delta weight sync over a real gloo group to two bf16 embedded servers (`weights.sync=delta`).

After a full first push, every push carries only the changed elements (a small share of the full push's
bytes) and each server's weights equal, checksum for checksum, what a full push of the same version gives
(the source cast to bf16); a server on another version gets a full push; a delta torn mid-push (the
sender gone before its last bucket) changes nothing on the servers."""

import os

import aiohttp
import pytest
import torch

from areal_like.weights import DiskWeightPusher, WeightPusher, WeightPushError
from areal_like.weights import delta, delta_sync

from conftest import free_port
from _weights import base_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rank 0 lives in this test process


@pytest.fixture(scope="module")
def servers(engine_servers, tiny_model_dir):
    return engine_servers(tiny_model_dir, 2, "--admin-api-key", ADMIN, "--dtype", "bfloat16",
                          "--weight-sync-timeout-s", "20")


async def call(method, url, path, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, headers=ADMIN_H,
                             timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


async def server_checksums(url) -> dict[str, str]:
    st, r = await call("POST", url, "/weights_checker", {"action": "checksum"})
    assert st == 200 and r["success"], r
    return r["ranks"][0]["checksums"]


def adamw_like_step(master: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An fp32 master update of about `lr` per element (AdamW's normalized step), in place."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t.add_(torch.randn(t.shape, generator=g).sign() * lr)


def full_push_checksums(master) -> dict[str, str]:
    return {n: delta.checksum(t.to(torch.bfloat16)) for n, t in master.items()}


def new_pusher(servers, **kw) -> WeightPusher:
    return WeightPusher([s.url for s in servers], master_port=free_port(), backend="gloo", bucket_bytes=32 << 10,
                        timeout_s=20, admin_api_key=ADMIN, dtype="bfloat16", overlap_loads=True, sync="delta", **kw)


async def test_deltas_after_a_full_push_land_bit_exact_and_carry_a_fraction_of_the_bytes(servers, base_model):
    master = {n: t.detach().clone() for n, t in base_model.state_dict().items()}
    pusher = new_pusher(servers, check_every=1)
    await pusher.init()
    try:
        first = await pusher.update(list(master.items()), version=1)
        assert not first.delta and first.checked and first.checked >= len(master) - 1
        for version in range(2, 7):
            adamw_like_step(master, lr=2e-6, seed=version)
            res = await pusher.update(list(master.items()), version=version)
            assert res.delta and 0 < res.changed < 0.5, res
            assert res.bytes < first.bytes / 3, (res.bytes, first.bytes)
            assert res.checked == first.checked  # every server, every common tensor, equal to a full push
        want = full_push_checksums(master)
        for srv in servers:
            have = await server_checksums(srv.url)
            assert {n: have[n] for n in want} == want
            st, info = await call("GET", srv.url, "/model_info")
            assert info["weight_version"] == "6"

        # a server on another version (restarted, or a push it missed): the next push is full, and lands
        st, _ = await call("POST", servers[1].url, "/update_weight_version", {"new_version": "elsewhere"})
        assert st == 200
        adamw_like_step(master, lr=2e-6, seed=7)
        res = await pusher.update(list(master.items()), version=7)
        assert not res.delta and res.bytes == first.bytes
        adamw_like_step(master, lr=2e-6, seed=8)
        res = await pusher.update(list(master.items()), version=8)
        assert res.delta
        want = full_push_checksums(master)
        for srv in servers:
            assert {n: (await server_checksums(srv.url))[n] for n in want} == want
    finally:
        await pusher.close()


async def test_a_torn_delta_changes_nothing_and_the_next_push_is_full(servers, base_model):
    master = {n: t.detach().clone() for n, t in base_model.state_dict().items()}
    pusher = new_pusher(servers)
    await pusher.init()
    try:
        await pusher.update(list(master.items()), version=30)
        before = [await server_checksums(s.url) for s in servers]
        # the sender sends the first bucket of a delta and dies: no last bucket ever arrives
        adamw_like_step(master, lr=1e-3, seed=31)
        packed, changed, _ = delta_sync.diff(pusher.sent, _source(master), pusher.dtype, pusher.bucket_bytes)
        described, buf = packed[0]
        assert changed and described
        body = {"deltas": described, "base_version": "30", "group_name": pusher.group_name,
                "weight_version": None, "load_format": "delta", "flush_cache": False}
        http = [pusher._send(s.url, "/update_weights_from_distributed", body) for s in servers]
        await pusher._with_collective(http, lambda: pusher.group.broadcast(buf, 0, what="torn bucket"))
        await pusher.reform()  # the learner's next incarnation: a new group; the staged bucket is dropped
        for srv, b in zip(servers, before):
            assert await server_checksums(srv.url) == b
            st, info = await call("GET", srv.url, "/model_info")
            assert info["weight_version"] == "30"
        res = await pusher.update(list(master.items()), version=31)
        assert not res.delta  # re-formed: the servers may hold anything the learner does not know
        want = full_push_checksums(master)
        for srv in servers:
            assert {n: (await server_checksums(srv.url))[n] for n in want} == want
    finally:
        await pusher.close()


async def test_a_delta_on_another_base_is_refused_whole_and_the_check_catches_a_drifted_server(servers, base_model,
                                                                                         monkeypatch):
    master = {n: t.detach().clone() for n, t in base_model.state_dict().items()}
    pusher = new_pusher(servers, check_every=1)
    await pusher.init()
    try:
        await pusher.update(list(master.items()), version=40)
        # the servers' version moved under the learner's feet between its check and its push
        pusher.sent.version = 39
        monkeypatch.setattr(delta_sync, "servers_hold", _always)  # the pre-check would send the full weights
        adamw_like_step(master, lr=1e-3, seed=41)
        before = await server_checksums(servers[0].url)
        with pytest.raises(WeightPushError, match="applies to version '39'.*holds version '40'"):
            await pusher.update(list(master.items()), version=41)
        assert await server_checksums(servers[0].url) == before and pusher.sent.version is None
        monkeypatch.undo()
        await pusher.reform()
        await pusher.update(list(master.items()), version=41)
        # a server whose weights drifted from what the learner sent: the check fails the push by name
        name = next(n for n in master if n.endswith("q_proj.weight"))
        master[name].add_(1.0)  # the learner's weights differ from what it will claim was sent
        pusher.sent.tensors[name].copy_(master[name].to(torch.bfloat16))  # …and its copy believes they were
        with pytest.raises(WeightPushError, match=f"differ from version 42.*{name}"):
            await pusher.update(list(master.items()), version=42)
    finally:
        await pusher.close()


async def _always(admin, version):
    return True


def _source(master):
    from areal_like.weights.source import LocalWeights

    return LocalWeights(list(master.items()))


async def test_deltas_through_the_file_system_land_bit_exact_and_a_wrong_or_torn_one_changes_nothing(
        servers, base_model, tiny_model_dir, tmp_path):
    """`weights.mode=disk`: after a full checkpoint dir, each push writes a delta dir (delta.safetensors +
    delta.json) the servers stage before the pause and apply inside it."""
    master = {n: t.detach().clone() for n, t in base_model.state_dict().items()}
    pusher = DiskWeightPusher([s.url for s in servers], out_dir=str(tmp_path / "w"), model_path=str(tiny_model_dir),
                              timeout_s=20, admin_api_key=ADMIN, dtype="bfloat16", shard_bytes=32 << 10,
                              sync="delta", check_every=1)
    await pusher.init()
    try:
        first = await pusher.update(list(master.items()), version=101)
        assert not first.delta and first.checked >= len(master) - 1
        for version in (102, 103, 104):
            adamw_like_step(master, lr=2e-6, seed=version)
            res = await pusher.update(list(master.items()), version=version)
            assert res.delta and 0 < res.changed < 0.5 and res.bytes < first.bytes / 3, res
            assert res.checked == first.checked
            assert sorted(os.listdir(res.path)) == ["delta.json", "delta.safetensors"]
        want = full_push_checksums(master)
        for srv in servers:
            assert {n: (await server_checksums(srv.url))[n] for n in want} == want
        before = [await server_checksums(s.url) for s in servers]
        # the servers hold 104: the delta 103 → 104 again is refused whole
        body = {"model_path": res.path, "load_format": "delta", "weight_version": "105"}
        st, r = await call("POST", servers[0].url, "/update_weights_from_disk", body)
        assert st == 200 and not r["success"] and "applies to version '103'" in r["message"], r
        # a torn file (the learner died while writing, or the disk filled): read fails, nothing changes
        torn = tmp_path / "torn"
        os.makedirs(torn)
        for name in ("delta.json", "delta.safetensors"):
            data = open(os.path.join(res.path, name), "rb").read()
            open(torn / name, "wb").write(data[:-7] if name.endswith(".safetensors") else data)
        st, r = await call("POST", servers[1].url, "/update_weights_from_disk", {**body, "model_path": str(torn)})
        assert st == 200 and not r["success"] and "Failed to read the delta update" in r["message"], r
        for srv, b in zip(servers, before):
            assert await server_checksums(srv.url) == b
            assert (await call("GET", srv.url, "/model_info"))[1]["weight_version"] == "104"
        # a server on another version: the next push is a full checkpoint dir, then deltas again
        await call("POST", servers[1].url, "/update_weight_version", {"new_version": "elsewhere"})
        adamw_like_step(master, lr=2e-6, seed=105)
        res = await pusher.update(list(master.items()), version=105)
        assert not res.delta and "model.safetensors" in "".join(os.listdir(res.path))
        adamw_like_step(master, lr=2e-6, seed=106)
        assert (await pusher.update(list(master.items()), version=106)).delta
        want = full_push_checksums(master)
        for srv in servers:
            assert {n: (await server_checksums(srv.url))[n] for n in want} == want
    finally:
        await pusher.close()
