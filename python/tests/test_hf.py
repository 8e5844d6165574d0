"""A trained zeropp checkpoint as a Hugging Face GPT-2: `zeropp ckpt export
--format hf` writes a directory that transformers loads with no code of
ours, and it computes what zeropp's own forward pass computes."""

import json
import subprocess

import pytest
import torch
import transformers
from safetensors.torch import load_file

TEXTS = ["First Citizen: Before we proceed", "ROMEO: But soft, what light thro"]


def zeropp(zeropp_bin, *args, check=True):
    p = subprocess.run([zeropp_bin, *args], capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def trained(zeropp_bin, tmp_path, *extra):
    ck = tmp_path / "ck"
    zeropp(
        zeropp_bin,
        "train",
        "--steps",
        "30",
        "--width",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--context",
        "32",
        "--batch",
        "4",
        "--log-every",
        "30",
        "--checkpoint-dir",
        str(ck),
        "--save-every",
        "30",
        *extra,
    )
    return ck


@pytest.mark.parametrize("head", ["untied", "tied"])
def test_transformers_loads_the_export_and_computes_the_same(zeropp_bin, tmp_path, head):
    ck = trained(zeropp_bin, tmp_path, "--tied-head", str(head == "tied").lower())
    out = tmp_path / "hf"
    zeropp(zeropp_bin, "ckpt", "export", str(ck), str(out), "--format", "hf")
    logits = tmp_path / "logits.safetensors"
    args = [a for t in TEXTS for a in ("--text", t)]
    ev = zeropp(zeropp_bin, "ckpt", "eval", str(ck), *args, "--logits", str(logits), "--json")
    ours = json.loads(ev.stdout)

    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings == (head == "tied")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # The tokenizer is the byte-level vocabulary: text in, its UTF-8 bytes
    # as ids, and back.
    ids = tok(TEXTS, return_tensors="pt").input_ids
    assert ids.tolist() == [list(t.encode()) for t in TEXTS]
    odd = "héllo\n wörld\t€"
    assert tok(odd).input_ids == list(odd.encode())
    assert tok.decode(list(odd.encode())) == odd

    with torch.no_grad():
        hf = model(ids, labels=ids)
    ref = load_file(logits)["logits"]
    assert ref.shape == hf.logits.shape == (2, len(TEXTS[0]), 256)
    diff = (hf.logits - ref).abs().max().item()
    assert diff <= 1e-4, f"logits differ by {diff}"
    assert abs(hf.loss.item() - ours["loss"]) <= 1e-4, (hf.loss.item(), ours)
    # It learned something: below the uniform loss ln 256 = 5.55.
    assert ours["loss"] < 4.5, ours

    # Greedy generation: transformers' and `zeropp generate`'s agree.
    prompt = "ROMEO:"
    with torch.no_grad():
        g = model.generate(
            tok(prompt, return_tensors="pt").input_ids, max_new_tokens=20, do_sample=False
        )
    gen = zeropp(
        zeropp_bin,
        "generate",
        str(ck),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
    )
    assert gen.stdout.rstrip("\n") == tok.decode(g[0])


def test_corrupt_or_mismatched_checkpoints_are_refused_with_the_file_named(zeropp_bin, tmp_path):
    ck = trained(zeropp_bin, tmp_path)
    step = ck / "step-00000030"
    out = tmp_path / "hf"
    # A model shape that is not the one saved: the manifest is blamed.
    manifest = step / "manifest.json"
    saved = manifest.read_text()
    m = json.loads(saved)
    m["config"]["model"]["width"] = 64
    manifest.write_text(json.dumps(m))
    p = zeropp(zeropp_bin, "ckpt", "export", str(ck), str(out), "--format", "hf", check=False)
    assert p.returncode != 0 and "manifest.json" in p.stderr, p.stderr
    assert not (out / "model.safetensors").exists()
    manifest.write_text(saved)
    # A damaged shard: named, nothing written.
    shard = step / "rank-00001.zst"
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    for cmd in (
        ["ckpt", "export", str(ck), str(out), "--format", "hf"],
        ["generate", str(ck), "--prompt", "a"],
    ):
        p = zeropp(zeropp_bin, *cmd, check=False)
        assert p.returncode != 0 and "rank-00001.zst" in p.stderr, p.stderr
    assert not (out / "model.safetensors").exists()


def test_generate_samples_deterministically_per_seed(zeropp_bin, tmp_path):
    ck = trained(zeropp_bin, tmp_path)

    def sample(seed):
        return zeropp(
            zeropp_bin,
            "generate",
            str(ck),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "40",
            "--seed",
            str(seed),
        ).stdout

    a, b, c = sample(3), sample(3), sample(4)
    assert a == b and a != c
    assert a.startswith("ROMEO:") and len(a) > len("ROMEO:") + 20
    p = zeropp(zeropp_bin, "generate", str(ck), "--prompt", "", check=False)
    assert p.returncode != 0 and "prompt is empty" in p.stderr
