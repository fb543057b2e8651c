"""``python -m dtrain.convert_hf export`` of a run folder: the shape comes from the run's
config.toml, the weights from its latest checkpoint, and the folder holds the run's tokenizer and
generation config, so transformers loads it, computes dtrain's logits and generates dtrain's
greedy tokens, with the BOS and EOS ids the run trained with."""

import json

import pytest
import torch
import transformers

from dtrain import Trainer, convert_hf, load_config

# fp32 on CPU: the two implementations differ only in the order of float operations.
ATOL = 1e-5
TINY = {"model.n_layers": 1, "training.steps": 5, "training.seq_len": 64,
        "training.global_batch_size": 2, "training.micro_batch_size": 1,
        "metrics.tensorboard": False, "metrics.log_every": 1}
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The debug recipe trained 5 steps with a checkpoint at step 5, its run folder exported
    (fp32) without --model: (trainer, run folder, export folder)."""
    root = tmp_path_factory.mktemp("export")
    trainer = Trainer(load_config("debug", {**TINY, "checkpoint.enabled": True,
                                            "checkpoint.interval": 5,
                                            "job.output_dir": str(root)}))
    trainer.train()
    folder = root / "debug"
    assert convert_hf.main(["export", str(folder), str(root / "hf"), "--dtype", "fp32"]) == 0
    return trainer, folder, root / "hf"


@pytest.fixture(scope="module")
def loaded(run):
    """The export as transformers loads it: (tokenizer, model)."""
    out = run[2]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    return tok, model.eval()


def test_the_export_of_a_run_folder_computes_dtrains_logits(run, loaded):
    trainer, _, _ = run
    tokens = torch.randint(0, 4096, (2, 40))
    with torch.no_grad():
        error = (loaded[1](tokens).logits - trainer.model(tokens)).abs().max().item()
    assert error < ATOL


def test_generate_gives_the_tokens_of_dtrains_greedy_loop(run, loaded):
    trainer, _, _ = run
    tok, model = loaded
    prompt = tok("some text", return_tensors="pt")
    assert prompt["input_ids"][0, 0].item() == trainer.tokenizer.bos_id  # BOS first, as trained
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
        ids = prompt["input_ids"]
        for _ in range(5):
            ids = torch.cat([ids, trainer.model(ids)[:, -1:].argmax(-1)], dim=1)
    new = generated[0, prompt["input_ids"].shape[1]:]
    assert len(new) == 5 and new.tolist() == ids[0, -5:].tolist()


def test_the_tokenizer_and_generation_config_carry_the_ids_dtrain_trained_with(run, loaded):
    trainer, _, out = run
    tok, model = loaded
    ours = trainer.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert tok.model_max_length == trainer.model.args.max_seq_len
    generation = json.loads((out / "generation_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for ids in (generation, config):
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    assert model.generation_config.eos_token_id == ours.eos_id


def test_a_step_folder_exports_the_same_files(run, tmp_path):
    _, folder, out = run
    step = folder / "checkpoints" / "step-0000005"
    assert convert_hf.main(["export", str(step), str(tmp_path), "--dtype", "fp32"]) == 0
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_the_default_dtype_is_bf16(run, tmp_path):
    _, folder, _ = run
    assert convert_hf.main(["export", str(folder), str(tmp_path), "--step", "5"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_preset_that_disagrees_with_the_run_is_refused_in_one_line(run, tmp_path, capsys):
    _, folder, _ = run  # llama3_debug has 4 layers; the run trained 1
    assert convert_hf.main(["export", str(folder), str(tmp_path), "--model",
                            "llama3_debug"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --model llama3_debug disagrees with {folder / 'config.toml'}: its n_layers is "
        "4, the run's 1; leave --model out for a run folder"]


def test_a_run_without_checkpoints_is_one_line_and_exit_2(tmp_path, capsys):
    Trainer(load_config("debug", {**TINY, "training.steps": 1,
                                  "job.output_dir": str(tmp_path)})).train()
    folder = tmp_path / "debug"
    capsys.readouterr()
    assert convert_hf.main(["export", str(folder), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {folder} has no checkpoint: the run saved none (checkpoint.enabled = false?) "
        "or was stopped before its first save; train with --checkpoint.enabled true"]
