"""Offline hub access fails fast and in one line naming the task and the fix; the local-task
command writes the YAML that fix names; model_args may name lm-eval's own flags."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import make_run

from mta_repro.eval import hub

FIX = Path(__file__).parent / "fixtures" / "eval"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def offline_env(tmp_path) -> dict:
    """No HF offline flags, no proxy, an empty HF cache, and a hub endpoint that refuses
    connections: what a machine without internet looks like, whatever this one has."""
    env = {
        k: v for k, v in os.environ.items() if k not in hub._OFFLINE_VARS + hub._PROXY_VARS and not k.startswith("HF_")
    }
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false"
    )
    return env


def test_reachable_tells_an_open_port_from_a_closed_one():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        assert hub.reachable("127.0.0.1", srv.getsockname()[1], timeout=2)
    finally:
        srv.close()
    assert not hub.reachable("127.0.0.1", closed_port(), timeout=2)


def test_unreachable_hub_switches_the_libraries_offline(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    for v in hub._OFFLINE_VARS + hub._PROXY_VARS:
        monkeypatch.delenv(v, raising=False)
    # restored after the test: offline_if_unreachable sets them
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub, "_probed", {})
    monkeypatch.setattr(hub, "_switched_offline", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert not hub.offline_if_unreachable()  # a proxy: a direct probe proves nothing
    assert "HF_HUB_OFFLINE" not in os.environ
    monkeypatch.delenv("HTTPS_PROXY")
    assert hub.offline_if_unreachable()
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    for v in hub._OFFLINE_VARS:
        monkeypatch.delenv(v)


def test_other_errors_pass_through_untouched():
    with pytest.raises(KeyError, match="x"), hub.hub_errors(["arc_easy"]):
        raise KeyError("x")
    assert hub.describe(ValueError("bad"), ["arc_easy"]) is None
    # a connection error that is not the hub's (a rank's peer gone) is not reported as one
    assert hub.describe(ConnectionResetError("Connection reset by peer"), ["arc_easy"]) is None
    msg = hub.describe(ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (x)"), ["lambada_openai"])
    assert msg.startswith(
        "lm-eval task 'lambada_openai': dataset 'EleutherAI/lambada_openai' is not in the local HF cache"
    )


def test_babilong_from_the_hub_offline_names_the_generated_source(tmp_path):
    code = (
        "from mta_repro.eval.babilong import load_hf\n"
        "try:\n    load_hf('qa1', '0k')\nexcept ValueError as e:\n    print('MSG', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=offline_env(tmp_path), timeout=300
    )
    msg = r.stdout.split("MSG ", 1)[1].strip()
    assert msg.startswith("babilong qa1 at 0k: dataset 'RMT-team/babilong' is not in the local HF cache")
    assert "babilong.source=generated" in msg and "\n" not in msg


@pytest.mark.slow
def test_lm_eval_cli_offline_fails_in_one_line_and_its_fix_writes_the_task(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="mta")
    env = offline_env(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.eval.lm_eval_cli",
            "--model_args",
            f"pretrained={run_dir},device=cpu",
            "--tasks",
            "arc_easy",
            "--limit",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "mta-lm-eval: error: lm-eval task 'arc_easy': dataset 'allenai/ai2_arc' is not in "
        "the local HF cache and 127.0.0.1 cannot be reached"
    ), line
    assert "python -m mta_repro.eval.lm_eval_tasks arc_easy test=FILE.jsonl --out DIR" in line
    # The fix it names writes the local task (write_local_task: lm-eval running such a YAML
    # offline is tests/test_eval_lm_eval_cli.py's) and says how to use it.
    w = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.eval.lm_eval_tasks",
            "arc_easy",
            f"test={FIX / 'lm_eval' / 'arc_easy_test.jsonl'}",
            "--out",
            str(tmp_path / "tasks"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert w.returncode == 0, w.stderr
    yaml = (tmp_path / "tasks" / "arc_easy_local.yaml").read_text()
    assert "task: arc_easy_local" in yaml and "arc_easy.yaml" in yaml.splitlines()[0]
    assert f"--include_path {tmp_path / 'tasks'} --tasks arc_easy_local" in w.stdout


def test_local_task_command_checks_its_arguments(tmp_path):
    from mta_repro.eval.lm_eval_tasks import main

    assert main(["arc_easy", f"test={tmp_path / 'nope.jsonl'}", "--out", str(tmp_path)]) == 2
    assert main(["arc_easy", "nosplit", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.glob("*.yaml"))


def test_model_args_may_name_device_and_batch_size(tmp_path):
    """``--model_args device=cpu`` beside lm-eval's own --device/--batch_size: the model_args
    value wins (lm-eval's default raised 'multiple values for keyword argument')."""
    from mta_repro.eval.lm_eval_model import MTAReproLM

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    lm = MTAReproLM.create_from_arg_string(
        f"pretrained={run_dir},device=cpu,batch_size=3", {"device": "cuda:0", "batch_size": 16, "max_batch_size": None}
    )
    assert str(lm._device) == "cpu" and lm.batch_size == 3
    lm = MTAReproLM.create_from_arg_obj({"pretrained": str(run_dir)}, {"device": "cpu", "batch_size": 5})
    assert lm.batch_size == 5
