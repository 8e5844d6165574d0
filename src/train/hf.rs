//! A checkpoint as a Hugging Face GPT-2 (`zeropp ckpt export --format hf`):
//! a directory `transformers.GPT2LMHeadModel.from_pretrained` loads with no
//! code of ours, and `AutoTokenizer` reads as the byte-level vocabulary.
//!
//! The built-in model is GPT-2's architecture computing GPT-2's numbers:
//! learned positions, pre-norm blocks with layer norm (ε = 1e-5) and biases,
//! fused q/k/v in one `[in, out]` matrix split q, k, v then heads (GPT-2's
//! `Conv1D` layout and split), scores scaled by 1/√head_dim, tanh-GELU
//! (`gelu_new`), 4× MLP, final layer norm, a head without bias, tied to the
//! token embedding or not. So the weights are renamed, and only the untied
//! head is transposed (`lm_head` is a `Linear`, `[out, in]`). Anything the
//! mapping depends on is checked before a byte is written; a model that
//! GPT-2 cannot compute is refused, not exported.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::train::checkpoint::{self, Manifest};
use crate::train::model::{ModelConfig, Unit};

/// GPT-2's name for one of our parameters (`unit`, `param` as in
/// `Unit::params`), and whether its matrix is transposed on the way.
fn gpt2_name(unit: &Unit, param: &str) -> Result<(String, bool)> {
    let block = |i: usize, p: &str| format!("transformer.h.{i}.{p}");
    Ok(match (unit, param) {
        (Unit::Embedding, "tokens") => ("transformer.wte.weight".into(), false),
        (Unit::Embedding, "positions") => ("transformer.wpe.weight".into(), false),
        (Unit::Block(i), p) => {
            let hf = match p {
                "ln1.weight" => "ln_1.weight",
                "ln1.bias" => "ln_1.bias",
                "attn.qkv.weight" => "attn.c_attn.weight",
                "attn.qkv.bias" => "attn.c_attn.bias",
                "attn.proj.weight" => "attn.c_proj.weight",
                "attn.proj.bias" => "attn.c_proj.bias",
                "ln2.weight" => "ln_2.weight",
                "ln2.bias" => "ln_2.bias",
                "mlp.up.weight" => "mlp.c_fc.weight",
                "mlp.up.bias" => "mlp.c_fc.bias",
                "mlp.down.weight" => "mlp.c_proj.weight",
                "mlp.down.bias" => "mlp.c_proj.bias",
                other => bail!("block parameter {other} has no GPT-2 counterpart"),
            };
            (block(*i, hf), false)
        }
        (Unit::Head, "ln.weight") => ("transformer.ln_f.weight".into(), false),
        (Unit::Head, "ln.bias") => ("transformer.ln_f.bias".into(), false),
        (Unit::Head, "out.weight") => ("lm_head.weight".into(), true),
        (u, p) => bail!("parameter {}.{p} has no GPT-2 counterpart", u.name()),
    })
}

/// GPT-2's `config.json` for `c`: every field that changes the numbers set
/// to what the built-in model computes, dropout off.
pub fn gpt2_config(c: &ModelConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab,
        "n_positions": c.context,
        "n_embd": c.width,
        "n_layer": c.layers,
        "n_head": c.heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": c.tied_head,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": "float32",
        "zeropp": "exported by zeropp ckpt export --format hf: tokens are UTF-8 bytes (ids 0-255)"
    })
}

/// GPT-2's byte → printable character map (`bytes_to_unicode`): the
/// byte-level BPE's alphabet, so byte `b` is the token of id `b`.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut n = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a Latin-1 code point")
            } else {
                n += 1;
                char::from_u32(255 + n).expect("a code point below 512")
            }
        })
        .collect()
}

/// A `tokenizers` byte-level BPE with no merges: text → its UTF-8 bytes as
/// ids, ids → bytes → text.
pub fn tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(id, ch)| (ch.to_string(), id.into()))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
}

/// Writes checkpoint `dir` as a GPT-2 directory `out` (created; files in it
/// replaced). Returns the number of tensors written.
/// The files [`export`] writes into its directory.
pub const FILES: &[&str] = &[
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
];

pub fn export(dir: &Path, m: &Manifest, out: &Path) -> Result<usize> {
    let c = &m.config.model;
    if c.vocab > 256 {
        bail!(
            "the model's vocabulary has {} ids; the byte-level tokenizer covers 256",
            c.vocab
        );
    }
    let weights = checkpoint::unit_weights(dir, m)?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (unit, flat) in &weights {
        let mut off = 0;
        for p in unit.params(c) {
            let values = &flat[off..off + p.numel()];
            off += p.numel();
            let (name, transpose) = gpt2_name(unit, &p.name)?;
            if transpose {
                let [rows, cols] = p.shape[..] else {
                    bail!("{name}: a matrix was expected, not shape {:?}", p.shape);
                };
                let mut t = vec![0.0; values.len()];
                for r in 0..rows {
                    for k in 0..cols {
                        t[k * rows + r] = values[r * cols + k];
                    }
                }
                tensors.push((name, vec![cols, rows], t));
            } else {
                tensors.push((name, p.shape.clone(), values.to_vec()));
            }
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // transformers reads only files that say they hold PyTorch's layout.
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    checkpoint::write_safetensors(&out.join("model.safetensors"), &tensors, Some(meta))?;
    let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_vec_pretty(v)?)
            .with_context(|| format!("cannot write {}", p.display()))
    };
    write_json("config.json", &gpt2_config(c))?;
    write_json("tokenizer.json", &tokenizer_json())?;
    write_json(
        "tokenizer_config.json",
        &serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": c.context,
            "clean_up_tokenization_spaces": false
        }),
    )?;
    Ok(tensors.len())
}

/// `zeropp ckpt export DIR OUT --format hf`, from the command line's paths.
pub fn export_dir(dir: &Path, out: &Path) -> Result<(usize, usize)> {
    let dir = checkpoint::resolve(dir)?;
    let m = checkpoint::read_manifest(&dir)?;
    Ok((export(&dir, &m, out)?, m.step))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_one_gpt2_name() {
        for tied_head in [false, true] {
            let c = ModelConfig {
                tied_head,
                layers: 3,
                ..ModelConfig::default()
            };
            let mut names = Vec::new();
            for u in c.units() {
                for p in u.params(&c) {
                    names.push(gpt2_name(&u, &p.name).unwrap().0);
                }
            }
            let n = names.len();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), n, "two parameters share a GPT-2 name");
            assert_eq!(n, 2 + 12 * 3 + 2 + usize::from(!tied_head));
        }
    }

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let chars = byte_chars();
        let mut uniq = chars.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), 256);
        // GPT-2's map: printable bytes stay, space is U+0120 'Ġ', newline U+010A.
        assert_eq!(chars[b'A' as usize], 'A');
        assert_eq!(chars[b' ' as usize], '\u{120}');
        assert_eq!(chars[b'\n' as usize], '\u{10A}');
        assert_eq!(chars[0], '\u{100}');
    }
}
