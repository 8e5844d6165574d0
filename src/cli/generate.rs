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

/// Runs `zeropp generate`: prints the prompt and the sampled bytes
/// (control characters shown as their pictures).
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
    println!("{}", printable(&all));
    Ok(())
}

/// The bytes as text a terminal shows as it is: UTF-8 (invalid sequences
/// as U+FFFD), control characters other than newline and tab as their
/// pictures (ESC as ␛, U+241B) — a sampled escape sequence would otherwise
/// move the cursor or recolour the terminal — and C1 controls as U+FFFD.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .map(|c| match c {
            '\n' | '\t' => c,
            '\u{0}'..='\u{1f}' => char::from_u32(0x2400 + c as u32).unwrap_or('\u{fffd}'),
            '\u{7f}' => '\u{2421}',
            '\u{80}'..='\u{9f}' => '\u{fffd}',
            _ => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn sampled_control_bytes_are_shown_not_sent_to_the_terminal() {
        let sampled = b"ROMEO:\n\tthe \x1b[2Jend\r\x07\x7f\xc2\x9b \xff caf\xc3\xa9";
        assert_eq!(
            printable(sampled),
            "ROMEO:\n\tthe \u{241b}[2Jend\u{240d}\u{2407}\u{2421}\u{fffd} \u{fffd} café"
        );
    }
}
