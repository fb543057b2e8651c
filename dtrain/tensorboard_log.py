"""The TensorBoard side of the metrics log: grouped tags, a run named after the job, the resolved
config as text.

Event files go to ``<run>/tb/<job>/``, so ``tensorboard --logdir <run>/tb`` (the command the run
prints) shows one run named after the job; ``--logdir <run>`` shows it as ``tb/<job>`` and
``--logdir <output_dir>`` as ``<job>/tb/<job>``, one run per job. Each metrics.jsonl key is the
tag ``<group>/<key>``, the group's own prefix dropped (``moe_load_imbalance`` is
``moe/load_imbalance``); the MoE layers' figures are grouped already (``moe/layer<i>/...``, a
list one tag per element).

What TensorBoard 2.x shows: the Custom Scalars tab lays the charts out in reading order from the
layout written here: train (the loss first, the validation loss on the same chart), perf,
memory, moe, then any key not listed below (``other/``). The Time Series tab (the one that opens
first) and the Scalars tab sort the groups by name, memory, moe, perf, train, and Time Series
opens only the first two; a card pinned there (train/loss) stays pinned in that browser. The
Text tab shows the resolved config (config.toml) of each launch, at the step it started from.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

# Each group's metrics.jsonl keys in reading order, one chart each; a tuple shares one chart.
GROUPS: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "train": (("loss", "val_loss"), "mtp_loss", "grad_norm", "lr", "val_perplexity",
              "nonfinite_skipped"),
    "perf": ("tokens_per_second_per_device", "mfu_percent", "tflops_per_device", "step_time_s",
             "data_wait_percent", "eta_s"),
    "memory": (("peak_memory_gib", "peak_reserved_gib"), "alloc_retries"),
    "moe": ("moe_load_imbalance", "aux_loss", "z_loss"),
}


def _keys(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else entry


GROUP_OF = {key: group for group, entries in GROUPS.items() for entry in entries
            for key in _keys(entry)}
# Record keys that are no scalar: the step (the x axis), the wall time, the skipped steps' numbers
# (their count, nonfinite_skipped, is one).
NOT_SCALARS = ("step", "time", "nonfinite_steps")
TOKENS_PER_EXPERT = re.compile(r"moe/layer(\d+)/tokens_per_expert/\d+")


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: ``loss`` -> ``train/loss``, ``eta_s`` ->
    ``perf/eta_s``, ``moe_load_imbalance`` -> ``moe/load_imbalance``; a key with a ``/`` is one
    already."""
    if "/" in key:
        return key
    group = GROUP_OF.get(key, "other")
    return f"{group}/{key.removeprefix(group + '_')}"


def tensorboard_scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's scalars by tag; a list is one scalar per element
    (``moe/layer0/tokens_per_expert/3``)."""
    scalars = {}
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        if isinstance(value, list):
            scalars.update({f"{tensorboard_tag(key)}/{i}": item for i, item in enumerate(value)})
        else:
            scalars[tensorboard_tag(key)] = value
    return scalars


def _charts(tags: set[str]) -> list[tuple[str, str, list[str]]]:
    """(category, title, tag patterns) of every chart the layout may hold, in reading order."""
    charts = []
    for group, entries in GROUPS.items():
        for entry in entries:
            names = [tensorboard_tag(key) for key in _keys(entry)]
            charts.append((group, names[0], [re.escape(name) for name in names]))
    charts.append(("moe", "moe/layer*/load_imbalance", [r"moe/layer\d+/load_imbalance"]))
    layers = sorted({int(m[1]) for tag in tags if (m := TOKENS_PER_EXPERT.fullmatch(tag))})
    charts += [("moe", f"moe/layer{i}/tokens_per_expert", [rf"moe/layer{i}/tokens_per_expert/\d+"])
               for i in layers]
    return charts


def custom_scalars_layout(tags: set[str]) -> dict[str, dict[str, list]]:
    """The Custom Scalars layout (``SummaryWriter.add_custom_scalars``'s form: category ->
    chart title -> ["Multiline", tag regexes]) of the charts that draw some of ``tags``, in
    reading order; a tag no chart draws gets its own in the last category, ``other``."""
    layout: dict[str, dict[str, list]] = {}
    drawn: set[str] = set()
    for category, title, patterns in _charts(tags):
        matched = {tag for tag in tags if any(re.fullmatch(p, tag) for p in patterns)}
        if matched:  # a chart of no tag would show empty
            layout.setdefault(category, {})[title] = ["Multiline", [p + "$" for p in patterns]]
            drawn |= matched
    for tag in sorted(tags - drawn):
        layout.setdefault("other", {})[tag] = ["Multiline", [re.escape(tag) + "$"]]
    return layout


def config_markdown(config_toml: str) -> str:
    """The resolved config as a Markdown code block (the Text tab renders Markdown)."""
    return f"```toml\n{config_toml.rstrip()}\n```"


class TensorBoardWriter:
    """One run's event files in ``folder`` (``<run>/tb/<job>``): ``config_toml`` as the text
    ``config`` at ``config_step`` when given, each record's scalars under their tags, and the
    Custom Scalars layout of the tags written so far, again whenever a record adds a chart
    (TensorBoard shows the last one). ``purge_step``: a resumed run's first step, from which on
    TensorBoard drops the earlier events (the steps trained again)."""

    def __init__(self, folder: Path, purge_step: int | None, config_toml: str = "",
                 config_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        _hide_tensorboard_thread_errors()
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)
        self._tags: set[str] = set()
        self._layout: dict = {}
        if config_toml:
            self._writer.add_text("config", config_markdown(config_toml), config_step)

    def write(self, step: int, record: dict) -> None:
        """``record``'s scalars at ``step`` (and the layout when it gains a chart), flushed."""
        scalars = tensorboard_scalars(record)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        if not scalars.keys() <= self._tags:
            self._tags |= scalars.keys()
            if (layout := custom_scalars_layout(self._tags)) != self._layout:
                self._writer.add_custom_scalars(layout)
                self._layout = layout
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _hide_tensorboard_thread_errors() -> None:
    """tensorboard's writer thread keeps its error for the writer's next call to raise (where
    ``MetricsLogger`` reports it) and dies of it too: that death prints no second traceback."""
    previous = threading.excepthook
    if getattr(previous, "hides_tensorboard_errors", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, OSError)
                and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.hides_tensorboard_errors = True
    threading.excepthook = hook
