"""Tokenizer, packing and the data-parallel, resumable loader."""

import json
import queue
import threading

import numpy as np
import pytest
import torch

from dtrain.config import ConfigError, DataConfig
from dtrain.data.loader import (
    DataLoader,
    PackedTokens,
    Prefetcher,
    build_text_dataset,
    read_documents,
)
from dtrain.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer("builtin:debug/tokenizer.json")


def test_shipped_tokenizer_round_trips_and_has_bos_eos(tokenizer):
    text = "Return the number of items in a container."
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.vocab_size == 4096


def test_tokenizer_folder_and_missing_file(tmp_path, tokenizer):
    from dtrain.assets import ROOT
    assert Tokenizer(ROOT / "debug").vocab_size == tokenizer.vocab_size
    with pytest.raises(FileNotFoundError, match="set data.tokenizer"):
        Tokenizer(tmp_path / "none.json")


def test_documents_are_packed_with_bos_and_eos(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["alpha beta", "gamma"]))
    data = build_text_dataset(DataConfig(path=str(path)), tokenizer, seq_len=3)
    stream = data.tokens.tolist()
    expected = (tokenizer.encode("alpha beta", bos=True, eos=True)
                + tokenizer.encode("gamma", bos=True, eos=True))
    assert stream == expected
    assert len(data) == (len(stream) - 1) // 3
    # Consecutive windows share one token: labels of one window continue into the next.
    assert data.window(0)[-1] == data.window(1)[0]


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        list(read_documents(path, "text"))


def test_missing_text_field_suggests_the_fields_present(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "x"}\n')
    with pytest.raises(ConfigError, match="has no field 'text': set data.text_field to one of "
                                          "content"):
        list(read_documents(path, "text"))


def test_too_little_data_is_a_config_error():
    with pytest.raises(ConfigError, match="fewer than one window"):
        PackedTokens(np.arange(5), seq_len=8)


def windows(loader: DataLoader, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        inputs, labels = loader.next_batch()
        assert inputs.shape == labels.shape
        assert np.array_equal(inputs[:, 1:].numpy(), labels[:, :-1].numpy())
        out += [row[0] for row in inputs.tolist()]
    return out


def test_ranks_split_each_step_without_overlap_or_loss():
    data = PackedTokens(np.arange(10_001), seq_len=10)  # window i starts with token 10 i
    single = DataLoader(data, micro_batch=4, seed=1)
    reference = windows(single, 6)  # 6 micro-batches of 4 = 3 steps of 8 at accum 2
    ranks = [DataLoader(data, micro_batch=2, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    per_rank = [windows(loader, 6) for loader in ranks]
    for step in range(3):
        want = sorted(reference[8 * step: 8 * (step + 1)])
        got = sorted(w for r in range(2) for w in per_rank[r][4 * step: 4 * (step + 1)])
        assert got == want
    assert not set(per_rank[0]) & set(per_rank[1])


def test_every_window_once_per_epoch_and_reshuffled_next_epoch():
    data = PackedTokens(np.arange(201), seq_len=10)  # 20 windows
    loader = DataLoader(data, micro_batch=5, seed=0)
    first, second = windows(loader, 4), windows(loader, 4)
    assert sorted(first) == sorted(second) == list(range(0, 200, 10))
    assert first != second


def test_resume_from_state_dict_continues_the_same_sequence():
    data = PackedTokens(np.arange(1001), seq_len=10)
    loader = DataLoader(data, micro_batch=3, seed=7)
    windows(loader, 5)
    state = loader.state_dict()
    rest = windows(loader, 5)
    resumed = DataLoader(data, micro_batch=3, seed=0)
    resumed.load_state_dict(state)
    assert windows(resumed, 5) == rest


@pytest.mark.parametrize("new_dp", [2, 4])
def test_resume_under_the_same_or_another_data_parallel_degree(new_dp):
    # Global batch 8 per step: 2 ranks x micro 4, or 4 ranks x micro 2, accumulation 1.
    data = PackedTokens(np.arange(5001), seq_len=10)
    single = DataLoader(data, micro_batch=8, seed=3)
    reference = windows(single, 6)
    before = [DataLoader(data, micro_batch=4, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for loader in before:
        windows(loader, 2)  # two steps
    state = before[0].state_dict()
    assert state == before[1].state_dict()  # the cursor is global, the same on every rank
    after = [DataLoader(data, micro_batch=8 // new_dp, dp_rank=r, dp_size=new_dp, seed=0)
             for r in range(new_dp)]
    for loader in after:
        loader.load_state_dict(state)
    per_rank = [windows(loader, 4) for loader in after]
    for step in range(4):
        n = 8 // new_dp
        got = sorted(w for ranks in per_rank for w in ranks[n * step: n * (step + 1)])
        assert got == sorted(reference[8 * (step + 2): 8 * (step + 3)])


def test_token_ids_outside_the_vocabulary_are_refused():
    data = PackedTokens(np.arange(101), seq_len=10)
    loader = DataLoader(data, micro_batch=2, seed=0, vocab_size=50, source="data.path = 'x'")
    with pytest.raises(ConfigError, match=r"data.path = 'x' holds token id \d+, outside the "
                                          "tokenizer's vocabulary of 50"):
        for _ in range(5):
            loader.next_batch()


def test_prefetcher_hands_out_the_loader_batches_and_state():
    data = PackedTokens(np.arange(1001), seq_len=10)
    plain = DataLoader(data, micro_batch=3, seed=5)
    expected = [plain.next_batch()[0] for _ in range(4)]
    prefetched = Prefetcher(DataLoader(data, micro_batch=3, seed=5), depth=2)
    got = [prefetched.next_batch()[0] for _ in range(2)]
    # The state is that after the batches handed out, not after those fetched ahead.
    assert prefetched.state_dict()["consumed"] == 6
    got += [prefetched.next_batch()[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with pytest.raises(RuntimeError, match="before the first batch"):
        prefetched.load_state_dict({"consumed": 0, "seed": 5})


def test_prefetcher_resumes_from_state_and_reraises_loader_errors():
    data = PackedTokens(np.arange(1001), seq_len=10)
    resumed = Prefetcher(DataLoader(data, micro_batch=3, seed=5))
    resumed.load_state_dict({"consumed": 6, "seed": 5})
    plain = DataLoader(data, micro_batch=3, seed=5)
    plain.load_state_dict({"consumed": 6, "seed": 5})
    assert torch.equal(resumed.next_batch()[0], plain.next_batch()[0])
    failing = Prefetcher(DataLoader(data, micro_batch=3, seed=5, vocab_size=10))
    with pytest.raises(ConfigError, match="outside the tokenizer's vocabulary"):
        failing.next_batch()


class LostLockQueue(queue.Queue):
    """A queue whose third put never returns: what the prefetch thread meets when a Ctrl-C
    landed inside the training thread's get() and left the queue's lock held."""

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self.puts = 0

    def put(self, item, block=True, timeout=None):
        self.puts += 1
        if self.puts == 3:
            threading.Event().wait()  # blocked for good, as on a lock nobody releases
        super().put(item, block, timeout)


class SlowFetch:
    """A loader whose third fetch takes ``delay`` seconds."""

    def __init__(self, loader, delay: float):
        self.loader, self.delay, self.fetches, self.completed = loader, delay, 0, 0
        self.state_key, self.dp_size = loader.state_key, loader.dp_size
        self.fetch_started = threading.Event()

    def next_batch(self):
        self.fetches += 1
        if self.fetches == 3:
            self.fetch_started.set()
            threading.Event().wait(self.delay)
        batch = self.loader.next_batch()
        self.completed += 1
        return batch

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def first_batches(data, count: int) -> list[torch.Tensor]:
    """The inputs of a plain loader's first ``count`` batches, as every prefetcher test draws."""
    plain = DataLoader(data, micro_batch=3, seed=5)
    return [plain.next_batch()[0] for _ in range(count)]


def closed_within(prefetcher, seconds: float) -> bool:
    closer = threading.Thread(target=prefetcher.close, daemon=True)
    closer.start()
    closer.join(seconds)
    return not closer.is_alive()


def test_prefetcher_close_returns_when_the_handover_is_stuck(monkeypatch):
    # Ctrl-C during the wait for a batch once hung the run's exit: close() joined a thread
    # blocked for good on the queue's lock. It now leaves that thread and rewinds the loader.
    data = PackedTokens(np.arange(1001), seq_len=10)
    monkeypatch.setattr(queue, "Queue", LostLockQueue)
    prefetched = Prefetcher(DataLoader(data, micro_batch=3, seed=5), depth=2)
    got = [prefetched.next_batch()[0]]
    while prefetched.loader.state_dict()["consumed"] < 9:  # the third batch fetched, stuck
        threading.Event().wait(0.01)
    assert closed_within(prefetched, 30)
    got += [prefetched.next_batch()[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, first_batches(data, 3), strict=True))


def test_prefetcher_close_waits_for_a_fetch_in_progress():
    # A fetch under way when close() is called finishes first: the loader is rewound after it,
    # not while the thread still reads it.
    data = PackedTokens(np.arange(1001), seq_len=10)
    slow = SlowFetch(DataLoader(data, micro_batch=3, seed=5), delay=3.0)
    prefetched = Prefetcher(slow, depth=2)
    got = [prefetched.next_batch()[0]]
    assert slow.fetch_started.wait(30)
    assert closed_within(prefetched, 60)
    assert slow.completed == 3  # the slow fetch ran to its end before close() returned
    got += [prefetched.next_batch()[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, first_batches(data, 3), strict=True))


def test_prefetcher_close_rewinds_to_the_batches_handed_out():
    data = PackedTokens(np.arange(1001), seq_len=10)
    plain = DataLoader(data, micro_batch=3, seed=5)
    expected = [plain.next_batch()[0] for _ in range(4)]
    prefetched = Prefetcher(DataLoader(data, micro_batch=3, seed=5), depth=2)
    first = [prefetched.next_batch()[0] for _ in range(2)]
    prefetched.close()  # two or more batches were fetched ahead and are dropped
    rest = [prefetched.next_batch()[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(first + rest, expected, strict=True))
    prefetched.close()
