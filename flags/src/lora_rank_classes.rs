//! `--lora-rank-classes`: adapter slots that hold small LoRA ranks only, so that the shard sizes
//! them (and their share of device memory) for those ranks instead of `--max-lora-rank`.

use std::fmt;
use std::str::FromStr;

/// One `RANK:COUNT` of the flag: `count` adapter slots that hold ranks up to `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankClass {
    pub rank: u32,
    pub count: u32,
}

impl FromStr for RankClass {
    type Err = String;

    /// The syntax and each number's own bounds; how the classes fit the other adapter flags is
    /// [`slot_ranks`]'s check.
    fn from_str(text: &str) -> Result<Self, String> {
        let malformed = || format!("`{text}` is not RANK:COUNT (e.g. 8:4)");
        let (rank, count) = text.split_once(':').ok_or_else(malformed)?;
        let rank: u32 = rank.trim().parse().map_err(|_| malformed())?;
        let count: u32 = count.trim().parse().map_err(|_| malformed())?;
        if rank == 0 {
            return Err(format!("`{text}`: a rank is at least 1"));
        }
        if count == 0 {
            return Err(format!("`{text}`: a class has at least 1 slot"));
        }
        Ok(Self { rank, count })
    }
}

impl fmt::Display for RankClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.rank, self.count)
    }
}

/// The whole flag, `RANK:COUNT[,RANK:COUNT...]`, its classes in the order given. Empty text
/// gives none, as an unset flag does (so does an empty `QUIVER_LORA_RANK_CLASSES`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankClasses(pub Vec<RankClass>);

impl FromStr for RankClasses {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        text.split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

impl fmt::Display for RankClasses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, class) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(",")?;
            }
            write!(f, "{class}")?;
        }
        Ok(())
    }
}

/// Each adapter slot's largest rank, in slot order: the classes' slots by ascending rank, then
/// the slots left at `max_lora_rank`. Empty without classes: every slot holds `max_lora_rank`
/// (Warmup's `slot_ranks` says the same). At least one slot keeps `max_lora_rank`, so every
/// adapter the shards load has a slot it fits.
pub fn slot_ranks(
    classes: &[RankClass],
    max_active_adapters: u32,
    max_lora_rank: u32,
) -> Result<Vec<u32>, String> {
    if classes.is_empty() {
        return Ok(Vec::new());
    }
    let mut sorted = classes.to_vec();
    sorted.sort_unstable_by_key(|class| class.rank);
    for pair in sorted.windows(2) {
        if pair[0].rank == pair[1].rank {
            return Err(format!(
                "--lora-rank-classes gives rank {} twice",
                pair[0].rank
            ));
        }
    }
    if let Some(class) = sorted.iter().find(|class| class.rank >= max_lora_rank) {
        return Err(format!(
            "--lora-rank-classes: rank {} must be below --max-lora-rank ({max_lora_rank}), the \
             rank of the slots outside the classes",
            class.rank
        ));
    }
    let in_classes: u64 = sorted.iter().map(|class| u64::from(class.count)).sum();
    if in_classes >= u64::from(max_active_adapters) {
        return Err(format!(
            "--lora-rank-classes puts {in_classes} slots in classes, but --max-active-adapters is \
             {max_active_adapters}: at least one slot must keep --max-lora-rank, so that every \
             adapter that loads can run"
        ));
    }
    let mut ranks = Vec::with_capacity(max_active_adapters as usize);
    for class in &sorted {
        ranks.extend(std::iter::repeat_n(class.rank, class.count as usize));
    }
    ranks.resize(max_active_adapters as usize, max_lora_rank);
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_cli::try_parse;
    use crate::ServingFlags;

    fn parse(args: &[&str]) -> Result<ServingFlags, String> {
        try_parse(args.iter().copied())
    }

    fn classes(text: &str) -> Vec<RankClass> {
        parse(&["--lora-rank-classes", text])
            .unwrap()
            .rank_classes()
            .to_vec()
    }

    #[test]
    fn classes_parse_in_the_order_given() {
        assert_eq!(
            classes("16:16,8:8"),
            vec![
                RankClass {
                    rank: 16,
                    count: 16
                },
                RankClass { rank: 8, count: 8 }
            ]
        );
        assert_eq!(classes("4:1"), vec![RankClass { rank: 4, count: 1 }]);
        // Empty text (an empty variable) is no classes, as is leaving the flag out.
        assert!(classes("").is_empty());
        assert!(parse(&[]).unwrap().rank_classes().is_empty());
    }

    #[test]
    fn malformed_classes_are_refused_naming_the_flag() {
        for (bad, why) in [
            ("8", "is not RANK:COUNT"),
            ("8:", "is not RANK:COUNT"),
            (":8", "is not RANK:COUNT"),
            ("8:x", "is not RANK:COUNT"),
            ("-8:2", "is not RANK:COUNT"),
            ("8:2:1", "is not RANK:COUNT"),
            ("8:2,", "is not RANK:COUNT"),
            (",", "is not RANK:COUNT"),
            ("0:4", "a rank is at least 1"),
            ("8:0", "at least 1 slot"),
        ] {
            let error = parse(&[&format!("--lora-rank-classes={bad}")]).unwrap_err();
            assert!(error.contains("--lora-rank-classes"), "{bad}: {error}");
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn slots_run_from_the_smallest_class_to_max_lora_rank() {
        let ranks = slot_ranks(&classes("16:16,8:8"), 32, 64).unwrap();
        let expected: Vec<u32> = [(8, 8), (16, 16), (64, 8)]
            .into_iter()
            .flat_map(|(rank, count)| std::iter::repeat_n(rank, count))
            .collect();
        assert_eq!(ranks, expected);
        assert_eq!(
            slot_ranks(&classes("63:7"), 8, 64).unwrap().last(),
            Some(&64)
        );
        // No classes: Warmup sends no ranks and the shard sizes every slot at --max-lora-rank.
        assert_eq!(slot_ranks(&[], 8, 64), Ok(Vec::new()));
    }

    #[test]
    fn classes_that_do_not_fit_the_other_adapter_flags_are_refused() {
        for (text, slots, max_rank, why) in [
            ("64:2", 8, 64, "rank 64 must be below --max-lora-rank (64)"),
            (
                "8:2,128:1",
                8,
                64,
                "rank 128 must be below --max-lora-rank (64)",
            ),
            ("8:2,8:1", 8, 64, "gives rank 8 twice"),
            (
                "8:4,16:4",
                8,
                64,
                "puts 8 slots in classes, but --max-active-adapters is 8",
            ),
            ("8:1", 0, 64, "--max-active-adapters is 0"),
        ] {
            let error = slot_ranks(&classes(text), slots, max_rank).unwrap_err();
            assert!(error.contains("--lora-rank-classes"), "{text}: {error}");
            assert!(error.contains(why), "{text}: {error}");
        }
    }
}
