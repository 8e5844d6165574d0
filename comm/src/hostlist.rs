//! Slurm hostlists (`SLURM_JOB_NODELIST`, `SLURM_STEP_NODELIST`): `gpu[01-04,07]`,
//! `a1,b[2-3]`, `rack[1-2]-n[01-02]`, expanded to host names in Slurm's
//! order, zero padding kept.

/// A hostlist that does not parse: the list, and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the hostlist {list:?} {problem}")]
pub struct BadHostlist {
    pub list: String,
    pub problem: String,
}

fn bad(list: &str, problem: impl Into<String>) -> BadHostlist {
    BadHostlist {
        list: list.into(),
        problem: problem.into(),
    }
}

/// Every host of `list`, in order.
pub fn expand(list: &str) -> Result<Vec<String>, BadHostlist> {
    let mut hosts = Vec::new();
    for entry in split_top_level(list)? {
        if entry.is_empty() {
            continue;
        }
        hosts.extend(expand_entry(&entry, list)?);
    }
    if hosts.is_empty() {
        return Err(bad(list, "names no host"));
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<String>, BadHostlist> {
    let (mut parts, mut cur, mut depth) = (Vec::new(), String::new(), 0usize);
    for c in list.chars() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| bad(list, "has an unbalanced ']'"))?
            }
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur).trim().to_string());
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if depth != 0 {
        return Err(bad(list, "has an unbalanced '['"));
    }
    parts.push(cur.trim().to_string());
    Ok(parts)
}

/// One entry: literal text and bracketed ranges, as a cartesian product.
fn expand_entry(entry: &str, list: &str) -> Result<Vec<String>, BadHostlist> {
    let Some(open) = entry.find('[') else {
        return Ok(vec![entry.to_string()]);
    };
    let close = open
        + entry[open..]
            .find(']')
            .ok_or_else(|| bad(list, "has an unbalanced '['"))?;
    let (prefix, body, rest) = (&entry[..open], &entry[open + 1..close], &entry[close + 1..]);
    let tails = expand_entry(rest, list)?;
    let mut out = Vec::new();
    for item in body.split(',') {
        let item = item.trim();
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        let bad = || {
            bad(
                list,
                format!("has {item:?}, which is not a number or a range a-b"),
            )
        };
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if b < a || b - a > 1_000_000 {
            return Err(bad());
        }
        let width = lo.len();
        for n in a..=b {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn slurm_hostlists_expand_in_order_with_their_padding() {
        assert_eq!(expand("node17").unwrap(), ["node17"]);
        assert_eq!(
            expand("gpu[01-04,07]").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(expand("a1,b[2-3]").unwrap(), ["a1", "b2", "b3"]);
        assert_eq!(
            expand("rack[1-2]-n[01-02]").unwrap(),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(expand("n[9-11]").unwrap(), ["n9", "n10", "n11"]);
        assert_eq!(
            expand("x[001-002]-ib,y").unwrap(),
            ["x001-ib", "x002-ib", "y"]
        );
    }

    #[test]
    fn malformed_hostlists_are_errors_not_panics() {
        for bad in [
            "", "gpu[01-", "gpu01]", "gpu[a-b]", "gpu[5-2]", "g[1-2", "g[]", "é[1-x]",
        ] {
            assert!(expand(bad).is_err(), "{bad:?}");
        }
    }
}
