//! `zeropp generate`: sample text from a trained checkpoint's model.

use std::path::PathBuf;

use anyhow::Result;

/// `zeropp generate`'s arguments.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint, or a checkpoint directory (its latest).
    pub dir: PathBuf,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0: greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample from the K most likely bytes (0: all 256).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs `zeropp generate`: prints the prompt and the sampled bytes.
pub fn run(args: GenerateArgs) -> Result<()> {
    let GenerateArgs {
        dir,
        prompt,
        max_new_tokens,
        temperature,
        top_k,
        seed,
    } = args;
    let model = crate::train::infer::Model::load(&dir)?;
    let new = model.generate(prompt.as_bytes(), max_new_tokens, temperature, top_k, seed)?;
    let mut all = prompt.into_bytes();
    all.extend(new);
    println!("{}", String::from_utf8_lossy(&all));
    Ok(())
}
