"""TensorBoard as a person reads it: tags grouped train/, perf/, memory/, moe/ (the loss first in
the Custom Scalars tab's layout), the run named after the job, the resolved config in the Text
tab. The last test trains a tiny run and asks a real ``tensorboard`` server over HTTP."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from dtrain import Trainer, load_config
from dtrain.assets import ROOT as ASSETS
from dtrain.config import MetricsConfig
from dtrain.metrics import MetricsLogger
from dtrain.tensorboard_log import config_markdown, custom_scalars_layout, tensorboard_scalars

# Every figure a logged step's record can hold (GPU, MoE, a skipped step), with a validation's.
RECORD = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3,
          "tokens_per_second_per_device": 1000.0, "tflops_per_device": 1.0, "step_time_s": 0.5,
          "data_wait_percent": 1.0, "peak_memory_gib": 2.0, "eta_s": 65.0,
          "peak_reserved_gib": 3.0, "alloc_retries": 0, "mfu_percent": 10.0,
          "aux_loss": 1.0, "z_loss": 4.6, "moe_load_imbalance": 1.4,
          "moe/layer1/load_imbalance": 1.4, "moe/layer1/tokens_per_expert": [3.0, 5.0],
          "nonfinite_steps": [6], "nonfinite_skipped": 1, "val_loss": 2.6,
          "val_perplexity": 13.5}


def test_every_record_key_has_a_tag_in_its_group():
    record = {"step": 7, **RECORD, "time": 1.7e9}
    assert list(tensorboard_scalars(record)) == [
        "train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_second_per_device",
        "perf/tflops_per_device", "perf/step_time_s", "perf/data_wait_percent",
        "memory/peak_memory_gib", "perf/eta_s", "memory/peak_reserved_gib",
        "memory/alloc_retries", "perf/mfu_percent", "moe/aux_loss", "moe/z_loss",
        "moe/load_imbalance", "moe/layer1/load_imbalance", "moe/layer1/tokens_per_expert/0",
        "moe/layer1/tokens_per_expert/1", "train/nonfinite_skipped", "train/val_loss",
        "train/val_perplexity"]  # not the step, the time, nor the skipped steps' numbers


def test_the_layout_reads_train_perf_memory_moe_with_the_loss_first():
    layout = custom_scalars_layout(set(tensorboard_scalars(RECORD)) | {"other/new_figure"})
    assert list(layout) == ["train", "perf", "memory", "moe", "other"]
    assert list(layout["train"].items())[0] == (
        "train/loss", ["Multiline", ["train/loss$", "train/val_loss$"]])  # one chart
    assert list(layout["perf"])[:2] == ["perf/tokens_per_second_per_device", "perf/mfu_percent"]
    assert layout["memory"]["memory/peak_memory_gib"][1] == ["memory/peak_memory_gib$",
                                                            "memory/peak_reserved_gib$"]
    assert list(layout["moe"]) == ["moe/load_imbalance", "moe/aux_loss", "moe/z_loss",
                                   "moe/layer*/load_imbalance", "moe/layer1/tokens_per_expert"]
    assert layout["other"] == {"other/new_figure": ["Multiline", ["other/new_figure$"]]}


def test_the_layout_has_no_chart_without_data():
    # A dense run on CPU: no MFU (no known peak), no reserved memory, no MoE, no validation yet.
    dense = {k: v for k, v in RECORD.items() if not k.startswith(("moe", "aux", "z_", "val",
                                                                 "mfu", "peak_res", "alloc",
                                                                 "nonfinite"))}
    layout = custom_scalars_layout(set(tensorboard_scalars(dense)))
    assert list(layout) == ["train", "perf", "memory"]
    assert list(layout["train"]) == ["train/loss", "train/grad_norm", "train/lr"]
    assert "perf/mfu_percent" not in layout["perf"]


def test_the_config_is_written_once_as_a_markdown_code_block(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLogger(MetricsConfig(), tmp_path / "tiny", enabled=True,
                            config_toml='[model]\nname = "llama3_debug"\n')
    for step in (1, 2):  # a notebook's two train() calls: the files open twice
        metrics.log(step, 2, RECORD)
        metrics.close()
    events = EventAccumulator(str(tmp_path / "tiny" / "tb" / "tiny"))
    events.Reload()
    (config,) = events.Tensors("config/text_summary")
    assert config.step == 0
    assert config.tensor_proto.string_val == [
        config_markdown('[model]\nname = "llama3_debug"\n').encode()]
    assert config_markdown("a = 1\n") == "```toml\na = 1\n```"
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_a_resumed_run_adds_its_config_at_the_step_it_resumed_from(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for resume_step, steps, config in ((0, (1, 2, 3), "steps = 4\n"), (2, (3, 4), "steps = 8\n")):
        metrics = MetricsLogger(MetricsConfig(), tmp_path / "tiny", enabled=True,
                                resume_step=resume_step, config_toml=config)
        for step in steps:
            metrics.log(step, 4, RECORD)
        metrics.close()
    events = EventAccumulator(str(tmp_path / "tiny" / "tb" / "tiny"))
    events.Reload()
    assert [(e.step, e.tensor_proto.string_val) for e in events.Tensors("config/text_summary")] \
        == [(0, [b"```toml\nsteps = 4\n```"]), (2, [b"```toml\nsteps = 8\n```"])]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]  # step 3 once


# ---- a real TensorBoard ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, **query):
    url = f"http://127.0.0.1:{port}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for_tags(server: subprocess.Popen, port: int, timeout: float = 90) -> dict:
    """The scalars plugin's tags once the server has loaded the run (skips the test when the
    server does not start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.skip(f"tensorboard did not start (exit {server.returncode}): "
                        f"{server.stderr.read()[-500:]}")
        try:
            tags = get(port, "/data/plugin/scalars/tags")
            if any("train/val_perplexity" in run for run in tags.values()):  # the last written
                return tags
        except OSError:  # not listening yet
            pass
        time.sleep(0.5)
    pytest.fail(f"tensorboard on port {port} did not show the run within {timeout} s")


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    """A tiny MoE run named "tiny": 2 steps, each logged, a validation at step 2."""
    out = tmp_path_factory.mktemp("tb")
    Trainer(load_config("debug", {
        "model.name": "mixtral_debug", "model.n_layers": 1, "training.seq_len": 32,
        "training.global_batch_size": 2, "training.micro_batch_size": 2, "training.steps": 2,
        "lr_schedule.warmup_steps": 1, "metrics.log_every": 1, "validation.enabled": True,
        "validation.interval": 2, "validation.steps": 1,
        "validation.path": str(ASSETS / "debug" / "corpus.jsonl"), "job.name": "tiny",
        "job.output_dir": str(out)})).train()
    return out


def test_tensorboard_shows_the_job_grouped_tags_and_the_config(output_dir):
    port = free_port()
    server = subprocess.Popen(  # the command the run prints
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(output_dir / "tiny" / "tb"),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        tags = wait_for_tags(server, port)
        assert get(port, "/data/runs") == ["tiny"]  # the job's name, not "."
        scalars = set(tags["tiny"])
        assert {tag.split("/")[0] for tag in scalars} == {"train", "perf", "memory", "moe"}
        assert {"train/loss", "train/grad_norm", "train/lr", "train/val_loss",
                "perf/tokens_per_second_per_device", "perf/data_wait_percent", "perf/eta_s",
                "memory/peak_memory_gib", "moe/load_imbalance",
                "moe/layer0/tokens_per_expert/7"} <= scalars

        layout = get(port, "/data/plugin/custom_scalars/layout")["category"]
        assert [c["title"] for c in layout] == ["train", "perf", "memory", "moe"]
        loss = layout[0]["chart"][0]
        assert loss == {"title": "train/loss",
                        "multiline": {"tag": ["train/loss$", "train/val_loss$"]}}
        # The layout written at step 2, when the validation added a chart, is the one shown.
        assert "train/val_perplexity" in [c["title"] for c in layout[0]["chart"]]
        drawn = get(port, "/data/plugin/custom_scalars/scalars", run="tiny",
                    tag="|".join(loss["multiline"]["tag"]))["tag_to_events"]
        assert {tag: [e[1] for e in events] for tag, events in drawn.items()} == {
            "train/loss": [1, 2], "train/val_loss": [2]}

        assert get(port, "/data/plugin/text/tags") == {"tiny": ["config/text_summary"]}
        (text,) = get(port, "/data/plugin/text/text", run="tiny", tag="config/text_summary")
        assert text["step"] == 0
        assert "<pre><code>[job]\nname = &quot;tiny&quot;" in text["text"]  # rendered Markdown
        assert ("[model]\nname = &quot;mixtral_debug&quot;\nhf_config = &quot;&quot;\n"
                "n_layers = 1\n") in text["text"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_the_run_is_named_after_the_job_from_each_logdir(output_dir):
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    def runs(logdir) -> list[str]:
        return sorted(EventMultiplexer().AddRunsFromDirectory(str(logdir)).Runs())

    assert runs(output_dir / "tiny" / "tb") == ["tiny"]
    assert runs(output_dir / "tiny") == ["tb/tiny"]
    assert runs(output_dir) == ["tiny/tb/tiny"]  # beside the other jobs' runs
