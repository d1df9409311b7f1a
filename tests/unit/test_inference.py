"""The engine seam's pure parts: the vllm command line and weight-transfer payloads
(checked exactly against hand-written lists), weights folders, the server-process owner
(with real processes), and the client's behaviour against nothing at all."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import EXAMPLES
from tmax.agent.policy import PolicyUnavailable
from tmax.inference import (
    EngineStartError,
    InferenceEngine,
    WeightSyncError,
    make_engine,
    read_weights,
    weights_dir,
    write_weights,
)
from tmax.inference.base import EngineError, check_weights_dir, full_state
from tmax.inference.http import HttpEngine, parse_version
from tmax.inference.process import ServerProcess, free_port, hf_server_command
from tmax.inference.vllm import (
    VLLMConfig,
    VLLMServer,
    nccl_group,
    nccl_init_info,
    nccl_update_info,
    reload_weights_rpc,
    vllm_env,
    vllm_serve_command,
)
from tmax.models.tiny import build_tiny_model, build_tokenizer, corpus_texts
from tmax.tasks import find_tasks


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))
    return build_tiny_model(tokenizer, n_layers=1, d_model=32, n_heads=2, seed=0)


@pytest.fixture(autouse=True)
def no_vllm_python(monkeypatch):
    """The commands below are those of a machine without $TMAX_VLLM_PYTHON."""
    monkeypatch.delenv("TMAX_VLLM_PYTHON", raising=False)


# -- vllm: command line, environment, payloads ---------------------------------------------

def test_vllm_serve_command_for_the_recipe_is_exact():
    config = VLLMConfig(model="/scratch/run/weights/v00000000", served_model_name="qwen3.5-9b",
                        host="0.0.0.0", port=8123, tensor_parallel_size=2,
                        data_parallel_size=4, dtype="bfloat16", max_model_len=65536,
                        gpu_memory_utilization=0.85, max_num_seqs=256, seed=3,
                        weight_transfer="nccl")
    assert vllm_serve_command(config) == [
        "vllm", "serve", "/scratch/run/weights/v00000000",
        "--served-model-name", "qwen3.5-9b", "--host", "0.0.0.0", "--port", "8123",
        "--tensor-parallel-size", "2", "--data-parallel-size", "4",
        "--dtype", "bfloat16", "--gpu-memory-utilization", "0.85", "--seed", "3",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--max-model-len", "65536", "--max-num-seqs", "256",
        "--hf-overrides", '{"head_dtype": "float32"}',
        "--weight-transfer-config", '{"backend": "nccl"}']
    assert config.gpus == 8 and config.url == "http://127.0.0.1:8123"
    assert vllm_env(config) == {"VLLM_SERVER_DEV_MODE": "1"}


def test_vllm_serve_command_minimal_and_folder_options_are_exact():
    config = VLLMConfig(model="m", fp32_head=False, weight_transfer="folder",
                        enforce_eager=True, extra_args=("--max-logprobs", "1"))
    assert vllm_serve_command(config, executable="/opt/vllm/bin/vllm") == [
        "/opt/vllm/bin/vllm", "serve", "m", "--served-model-name", "policy",
        "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1",
        "--data-parallel-size", "1", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.9", "--seed", "0",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--enforce-eager", "--max-logprobs", "1"]
    no_sync = VLLMConfig(model="m", weight_transfer=None)
    assert "--weight-transfer-config" not in vllm_serve_command(no_sync)
    assert json.loads(vllm_serve_command(VLLMConfig(model="m"))[-1]) == {"head_dtype": "float32"}


def test_a_venv_python_runs_the_api_server_module_with_the_cpu_environment(monkeypatch):
    config = VLLMConfig(model="/m", python="/venv/bin/python", device="cpu",
                        cpu_kvcache_gib=2, dtype="float32", reasoning_parser="qwen3",
                        language_model_only=True)
    assert vllm_serve_command(config)[:5] == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert vllm_serve_command(config)[-4:] == [
        '{"head_dtype": "float32"}', "--reasoning-parser", "qwen3", "--language-model-only"]
    assert vllm_env(config) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
                                "VLLM_CPU_KVCACHE_SPACE": "2"}
    monkeypatch.setenv("TMAX_VLLM_PYTHON", "/other/bin/python")
    assert vllm_serve_command(VLLMConfig(model="/m"))[:3] == [
        "/other/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm_serve_command(config)[0] == "/venv/bin/python"  # the config's wins


def test_disk_is_not_a_vllm_backend():
    with pytest.raises(ValueError, match="'disk' is not a vLLM backend.*'folder'"):
        VLLMConfig(model="m", weight_transfer="disk")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"tensor_parallel_size": 0}, {"gpu_memory_utilization": 0},
                                 {"weight_transfer": "rdma"}])
def test_vllm_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        VLLMConfig(model="m", **bad)


def test_nccl_init_info_lays_ranks_out_after_the_trainer():
    wire = {"packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    assert nccl_init_info("10.0.0.5", 29555, rank_offset=1, world_size=9) == {
        "master_address": "10.0.0.5", "master_port": 29555, "rank_offset": 1,
        "world_size": 9, **wire}
    pool = [VLLMConfig(model="m", tensor_parallel_size=2), VLLMConfig(model="m"),
            VLLMConfig(model="m", tensor_parallel_size=2, data_parallel_size=2)]
    assert nccl_group(pool, "trainer-0", 40000) == [
        {"master_address": "trainer-0", "master_port": 40000, "rank_offset": 1,
         "world_size": 8, **wire},
        {"master_address": "trainer-0", "master_port": 40000, "rank_offset": 3,
         "world_size": 8, **wire},
        {"master_address": "trainer-0", "master_port": 40000, "rank_offset": 4,
         "world_size": 8, **wire}]
    with pytest.raises(ValueError, match="rank 0"):
        nccl_init_info("h", 1, rank_offset=0, world_size=2)


def test_nccl_update_info_is_vllms_payload():
    # vLLM's NCCLWeightTransferUpdateInfo: names, dtype_names, shapes and nothing else (the
    # packed* wire parameters belong to the init info); tests/integration/test_nccl_sync.py validates
    # both payloads with the installed vLLM's own classes
    params = [("model.embed_tokens.weight", torch.bfloat16, torch.Size([32, 8])),
              ("lm_head.weight", torch.float32, (32, 8)),
              ("model.norm.weight", "bfloat16", [8])]
    assert nccl_update_info(params) == {
        "names": ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"],
        "dtype_names": ["bfloat16", "float32", "bfloat16"],
        "shapes": [[32, 8], [32, 8], [8]]}
    # every dtype name resolves as vLLM resolves it: getattr(torch, name)
    assert all(isinstance(getattr(torch, d), torch.dtype)
               for d in nccl_update_info(params)["dtype_names"])


def test_reload_weights_rpc_needs_an_absolute_folder(tmp_path):
    assert reload_weights_rpc(tmp_path) == {"method": "reload_weights",
                                            "kwargs": {"weights_path": str(tmp_path)}}
    with pytest.raises(ValueError, match="absolute"):
        reload_weights_rpc("relative/v00000001")


def test_vllms_initial_weight_version_is_version_zero():
    assert parse_version("default") == 0 and parse_version("7") == 0 + 7
    with pytest.raises(EngineError, match="neither an integer"):
        parse_version("v7", "e")
    with pytest.raises(EngineError):
        parse_version(None, "e")


def test_the_vllm_backend_imports_without_vllm():
    code = ("import sys, tmax.inference.vllm, tmax.inference.hf_server, tmax.inference.http; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""


# -- weights folders -----------------------------------------------------------------------

def test_weights_folder_round_trip_with_marker_last(tiny, tmp_path):
    folder = write_weights(tiny, tmp_path, 12)
    assert folder == weights_dir(tmp_path, 12) == tmp_path / "v00000012"
    assert json.loads((folder / "tmax-weights.json").read_text()) == {"version": 12}
    state = read_weights(folder, version=12)
    full = full_state(tiny, state, engine="t", version=12)
    assert set(full) == set(tiny.state_dict())
    for key, tensor in tiny.state_dict().items():
        assert torch.equal(full[key], tensor), key
    assert check_weights_dir(folder, version=12) == folder
    with pytest.raises(WeightSyncError, match="holds version 12"):
        read_weights(folder, version=13)
    (folder / "tmax-weights.json").unlink()
    with pytest.raises(WeightSyncError, match="incomplete"):
        read_weights(folder, engine="e", version=12)
    assert read_weights(folder, require_marker=False).keys() == state.keys()


def test_full_state_names_what_does_not_fit(tiny):
    state = {k: v for k, v in tiny.state_dict().items() if "norm" not in k}
    with pytest.raises(WeightSyncError, match="missing") as info:
        full_state(tiny, state, engine="e", version=4)
    assert info.value.version == 4 and info.value.engine == "e"
    state = dict(tiny.state_dict())
    key = next(k for k in state if k.endswith("norm.weight"))
    state[key] = torch.zeros(3)
    with pytest.raises(WeightSyncError, match="shape"):
        full_state(tiny, state, engine="e", version=4)


# -- the client with no server, the process owner with real processes ----------------------

def test_a_client_without_a_server_is_unavailable_not_an_answer(tmp_path):
    engine = make_engine("http", base_url=f"http://127.0.0.1:{free_port()}/v1", model="m",
                         max_retries=1, backoff_s=0.01)
    assert isinstance(engine, InferenceEngine) and engine.root.startswith("http://127.0.0.1:")

    async def go():
        try:
            assert not await engine.health()
            with pytest.raises(PolicyUnavailable):
                await engine.complete([{"role": "user", "content": "hi"}])
            with pytest.raises(PolicyUnavailable):
                await engine.pause()
            folder = write_weights(build_tiny_model(
                build_tokenizer(["a b c"] * 4, vocab_size=300), n_layers=1, d_model=16,
                n_heads=2), tmp_path, 1)
            with pytest.raises(WeightSyncError) as info:
                await engine.update_weights_from_path(folder, 1)
            return info.value
        finally:
            await engine.aclose()

    error = asyncio.run(go())
    assert error.version == 1 and engine.version == 0
    with pytest.raises(ValueError, match="choose one of: http, inprocess"):
        make_engine("sglang")


def test_server_process_that_exits_fails_fast_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no GPU here', flush=True); sys.exit(3)"]
    server = ServerProcess(argv, url=f"http://127.0.0.1:{free_port()}",
                           log_path=tmp_path / "s.log", name="vllm:test", start_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        asyncio.run(server.start())
    assert time.monotonic() - started < 30
    assert "exited with code 3" in str(info.value) and "no GPU here" in info.value.log_tail


def test_server_process_past_its_deadline_is_stopped_with_its_group(tmp_path):
    marker = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    server = ServerProcess([sys.executable, "-c", code], url=f"http://127.0.0.1:{free_port()}",
                           log_path=tmp_path / "s.log", start_timeout_s=2, stop_grace_s=2)
    with pytest.raises(EngineStartError, match="not healthy"):
        asyncio.run(server.start())
    assert not server.alive()
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the server's child {child} outlived the stop")


def test_server_commands_are_argv_lists(tmp_path):
    argv = hf_server_command(tmp_path / "m", port=8001, max_batch=4, max_tokens=32,
                             temperature=0.7, served_model_name="tiny", seed=5)
    assert argv[:2] == [sys.executable, "-c"] and argv[3:] == [
        "serve", str(tmp_path / "m"), "--host", "127.0.0.1", "--port", "8001",
        "--max-batch", "4", "--max-tokens", "32", "--temperature", "0.7",
        "--served-model-name", "tiny", "--seed", "5"]
    server = VLLMServer(VLLMConfig(model="m", port=8002), log_path=tmp_path / "v.log")
    assert server.process.argv[:3] == ["vllm", "serve", "m"]
    assert server.process.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert server.engine.root == "http://127.0.0.1:8002"


# -- the weight-sync request sequence, exactly (against a recorder: NCCL cannot run here) --

class Recorder:
    """Answers vLLM's dev routes as vLLM does and records each request; ``fail`` names a
    route that answers 500, ``hold`` one that answers only once ``released`` is set."""

    def __init__(self, fail: str | None = None, hold: str | None = None):
        self.calls: list[tuple[str, str, dict]] = []
        self.fail, self.hold, self.version = fail, hold, "default"
        self.released: asyncio.Event | None = None

    def app(self):
        from aiohttp import web

        async def handle(request):
            body = await request.json() if request.can_read_body else {}
            route = request.path + (f"?{request.query_string}" if request.query_string else "")
            self.calls.append((request.method, route, body))
            if request.path == self.fail:
                return web.json_response({"error": "boom"}, status=500)
            if request.path == self.hold:
                await self.released.wait()
            if request.path == "/finish_weight_update":
                self.version = body["weight_version"]
            if request.path == "/update_weight_version":
                self.version = body["new_version"]
                return web.json_response({"success": True, "new_version": self.version})
            if request.path == "/weight_info":
                return web.json_response({"weight_version": self.version})
            if request.path == "/reset_prefix_cache":
                return web.json_response({"success": True})
            if request.path == "/collective_rpc":
                return web.json_response({"results": [None]})
            return web.json_response({"message": "ok"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app


async def serve(recorder: Recorder, body):
    from aiohttp import web

    recorder.released = asyncio.Event()
    runner = web.AppRunner(recorder.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engine = HttpEngine(f"http://127.0.0.1:{port}/v1", "m", max_retries=0)
    try:
        return await body(engine)
    finally:
        await engine.aclose()
        await runner.cleanup()


def test_folder_sync_is_a_reload_through_vllms_dev_routes(tiny, tmp_path):
    folder = write_weights(tiny, tmp_path, 5)
    recorder = Recorder()

    async def go(engine):
        before = await engine.refresh_version()
        await engine.update_weights_from_path(folder, 5)
        return before, engine.version

    assert asyncio.run(serve(recorder, go)) == (0, 5)
    assert recorder.calls[1:] == [
        ("POST", "/pause?mode=wait", {}),
        ("POST", "/collective_rpc", {"method": "reload_weights",
                                     "kwargs": {"weights_path": str(folder)}}),
        ("POST", "/reset_prefix_cache", {}),
        ("POST", "/update_weight_version", {"new_version": "5"}),
        ("GET", "/weight_info", {}), ("POST", "/resume", {})]


def test_nccl_sync_posts_update_weights_while_the_trainer_broadcasts():
    recorder = Recorder(hold="/update_weights")
    info = nccl_update_info([("w", torch.float32, (2, 2))])
    order = []

    async def broadcast():
        await asyncio.sleep(0.2)  # the receivers are already waiting in /update_weights
        order.append(len(recorder.calls))
        recorder.released.set()

    async def go(engine):
        await engine.init_weight_transfer(nccl_init_info("h", 29500, rank_offset=1,
                                                         world_size=2))
        await engine.update_weights_from_broadcast(info, 2, broadcast)
        return engine.version

    assert asyncio.run(serve(recorder, go)) == 2
    assert recorder.calls == [
        ("POST", "/init_weight_transfer_engine", {"init_info": {
            "master_address": "h", "master_port": 29500, "rank_offset": 1, "world_size": 2,
            "packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}}),
        ("POST", "/pause?mode=wait", {}), ("POST", "/start_weight_update", {}),
        ("POST", "/update_weights", {"update_info": info}),
        ("POST", "/finish_weight_update", {"weight_version": "2"}),
        ("GET", "/weight_info", {}), ("POST", "/resume", {})]
    assert order == [4]  # the broadcast ran while /update_weights was open


def test_a_failed_update_is_a_weight_sync_error_and_the_engine_is_resumed(tiny, tmp_path):
    folder = write_weights(tiny, tmp_path, 1)
    recorder = Recorder(fail="/collective_rpc")
    with pytest.raises(WeightSyncError) as info:
        asyncio.run(serve(recorder, lambda e: e.update_weights_from_path(folder, 1)))
    assert info.value.version == 1 and "/collective_rpc" in info.value.reason
    assert [c[1] for c in recorder.calls] == ["/pause?mode=wait", "/collective_rpc",
                                              "/resume"]


def test_a_request_refused_because_the_engine_is_paused_waits_for_resume():
    """vLLM >= 0.33 answers a request that arrives while paused with HTTP 503
    engine_paused: the client waits for /resume and sends it again (no infra failure)."""
    from aiohttp import web

    state = {"paused": True, "refused": 0}

    async def chat(request):
        if state["paused"]:
            state["refused"] += 1
            return web.json_response({"error": {"message": "engine_paused", "code": 503,
                                                "type": "ServiceUnavailableError"}}, status=503)
        return web.json_response({
            "choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "token_ids": [7],
                         "logprobs": {"content": [{"token": "ok", "logprob": -0.5}]}}],
            "prompt_token_ids": [1, 2]})

    async def is_paused(request):
        return web.json_response({"is_paused": state["paused"]})

    async def go():
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", chat), web.get("/is_paused", is_paused)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        engine = HttpEngine(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.05)
        loop = asyncio.get_running_loop()
        loop.call_later(0.8, state.update, {"paused": False})
        try:
            return await engine.complete([{"role": "user", "content": "hi"}])
        finally:
            await engine.aclose()
            await runner.cleanup()

    completion = asyncio.run(go())
    assert completion.completion_ids == [7] and completion.prompt_ids == [1, 2]
    assert state["refused"] >= 2


def test_a_503_from_a_server_that_is_not_paused_is_still_an_infra_failure():
    from aiohttp import web

    async def chat(request):
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async def is_paused(request):
        return web.json_response({"is_paused": False})

    async def go():
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", chat), web.get("/is_paused", is_paused)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        engine = HttpEngine(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.05)
        try:
            with pytest.raises(PolicyUnavailable, match="overloaded"):
                await engine.complete([{"role": "user", "content": "hi"}])
        finally:
            await engine.aclose()
            await runner.cleanup()

    asyncio.run(go())


def test_a_tied_head_is_served_untied_and_written_under_its_own_name(tiny, tmp_path):
    """vLLM 0.32's in-place reload leaves a tied LM head on the old weights: TMax serves a
    tied model from an untied copy and writes the head into every weights folder."""
    from safetensors.torch import load_file

    from tmax.inference.base import TIED_HEAD_FILE, tied_head_name
    from tmax.inference.vllm import serving_dir
    from tmax.models.tiny import save_pretrained_dir

    assert tied_head_name(tiny) == "lm_head.weight"
    folder = write_weights(tiny, tmp_path / "w", 1)
    head = load_file(str(folder / TIED_HEAD_FILE))["lm_head.weight"]
    assert torch.equal(head, tiny.lm_head.weight)
    full = full_state(tiny, read_weights(folder, version=1), engine="e", version=1)
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])

    tokenizer = build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))
    model_dir = save_pretrained_dir(tiny, tokenizer, tmp_path / "m")
    served = serving_dir(model_dir)
    assert served == tmp_path / "m.vllm-untied" and serving_dir(model_dir) == served
    assert json.loads((served / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    assert torch.equal(load_file(str(served / TIED_HEAD_FILE))["lm_head.weight"],
                       tiny.model.embed_tokens.weight)
    assert (served / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()
    assert serving_dir(tmp_path / "absent") == tmp_path / "absent"
    server = VLLMServer(VLLMConfig(model=str(model_dir), port=8003), log_path=tmp_path / "l")
    assert server.process.argv[2] == str(served)


def test_the_vllm_policy_names_its_server_and_refuses_a_folder_without_a_model(tiny, tmp_path,
                                                                              monkeypatch):
    from tmax.agent.policies.choose import make_policy
    from tmax.models.tiny import save_pretrained_dir

    monkeypatch.setenv("TMAX_VLLM_PYTHON", "/venv/bin/python")
    monkeypatch.setenv("TMAX_VLLM_DEVICE", "cpu")
    folder = save_pretrained_dir(tiny, build_tokenizer(corpus_texts(find_tasks(EXAMPLES))),
                                 tmp_path / "m")
    policy = make_policy(f"vllm:{folder}", temperature=0.5, max_tokens=32)
    assert policy.name == f"vllm:{folder}" and policy.server.engine.name == policy.name
    argv, env = policy.server.process.argv, policy.server.process.env
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                        "--model", str(tmp_path / "m.vllm-untied")]
    assert argv[argv.index("--dtype") + 1] == "auto" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert policy.server.engine.policy.temperature == 0.5
    with pytest.raises(ValueError, match="no config.json"):
        make_policy(f"vllm:{tmp_path}")
