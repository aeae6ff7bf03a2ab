//! The kernel's CPU list format (`0-3,6,8-9`), as in `/sys/devices/system/cpu/online` and
//! `Cpus_allowed_list`.

/// A malformed CPU list.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{text:?} is not a CPU list (expected numbers and ranges such as 0-3,6)")]
pub struct CpuListError {
    /// The text given.
    pub text: String,
}

/// Parses a CPU list into ascending, distinct CPU numbers. An empty text is an empty list.
pub fn parse(text: &str) -> Result<Vec<usize>, CpuListError> {
    let bad = || CpuListError { text: text.to_string() };
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => {
                (a.trim().parse::<usize>().map_err(|_| bad())?, b.trim().parse::<usize>().map_err(|_| bad())?)
            }
            None => {
                let n = part.trim().parse::<usize>().map_err(|_| bad())?;
                (n, n)
            }
        };
        if hi < lo || hi >= 1 << 16 {
            return Err(bad());
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Formats ascending CPU numbers as a CPU list with ranges (`[0,1,2,5]` → `0-2,5`).
pub fn format(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_lists_with_ranges() {
        assert_eq!(parse("0-3,6,8-9\n").unwrap(), vec![0, 1, 2, 3, 6, 8, 9]);
        assert_eq!(format(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(parse("").unwrap(), Vec::<usize>::new());
        assert_eq!(parse("5,1").unwrap(), vec![1, 5]);
        assert!(parse("3-1").is_err() && parse("a").is_err() && parse("0-").is_err());
    }
}
