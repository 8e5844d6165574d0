//! `zeropp generate`: sample text from a trained checkpoint's model.

use std::io::Write;
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

/// Runs `zeropp generate`: prints the prompt and the sampled bytes as they
/// come (control characters shown as their pictures).
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
    let mut out = std::io::stdout().lock();
    let mut text = Printer::default();
    text.push(prompt.as_bytes(), &mut out)?;
    let mut each = |b: u8| text.push(&[b], &mut out);
    let sampling = (temperature, top_k, seed);
    model.generate_each(prompt.as_bytes(), max_new_tokens, sampling, &mut each)?;
    text.finish(&mut out)?;
    Ok(())
}

/// Bytes printed as they come, [`printable`]: a UTF-8 sequence is held
/// until it is whole (a character sampled a byte at a time prints once).
#[derive(Default)]
struct Printer {
    pending: Vec<u8>,
}

impl Printer {
    fn push(&mut self, bytes: &[u8], out: &mut impl Write) -> Result<()> {
        self.pending.extend_from_slice(bytes);
        let whole = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            // An invalid sequence is shown (as U+FFFD) with what precedes
            // it; an incomplete one at the end waits for its bytes.
            Err(e) => e.valid_up_to() + e.error_len().unwrap_or(0),
        };
        if whole > 0 {
            let done: Vec<u8> = self.pending.drain(..whole).collect();
            out.write_all(printable(&done).as_bytes())?;
            out.flush()?;
            if !self.pending.is_empty() {
                return self.push(&[], out);
            }
        }
        Ok(())
    }

    fn finish(&mut self, out: &mut impl Write) -> Result<()> {
        let rest = std::mem::take(&mut self.pending);
        writeln!(out, "{}", printable(&rest))?;
        out.flush()?;
        Ok(())
    }
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
    use super::{Printer, printable};

    const SAMPLED: &[u8] = b"ROMEO:\n\tthe \x1b[2Jend\r\x07\x7f\xc2\x9b \xff caf\xc3\xa9";

    #[test]
    fn sampled_control_bytes_are_shown_not_sent_to_the_terminal() {
        assert_eq!(
            printable(SAMPLED),
            "ROMEO:\n\tthe \u{241b}[2Jend\u{240d}\u{2407}\u{2421}\u{fffd} \u{fffd} café"
        );
    }

    #[test]
    fn bytes_printed_one_at_a_time_show_what_the_whole_text_shows() {
        let mut out = Vec::new();
        let mut p = Printer::default();
        for &b in SAMPLED {
            p.push(&[b], &mut out).unwrap();
        }
        // An incomplete character at the end is shown once the text ends.
        p.push(b"\xc3", &mut out).unwrap();
        p.finish(&mut out).unwrap();
        let mut whole = SAMPLED.to_vec();
        whole.push(0xc3);
        assert_eq!(String::from_utf8(out).unwrap(), printable(&whole) + "\n");
    }
}
