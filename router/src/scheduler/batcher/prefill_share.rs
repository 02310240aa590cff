//! How one step's prefill budget is shared between the prompts already under way (chunked
//! prefill) and the requests waiting to start.
//!
//! Prompts under way used to take the whole budget first, so a 4-token request waited until
//! two long prompts ahead of it had finished prefilling. Now every party gets a max-min fair
//! share (water filling: a party that needs less than an equal share gets what it needs, and
//! the rest is split evenly among the others): first between the tenants of the prompts under
//! way plus the waiting queue as one more party, then between each tenant's own prompts. A
//! tenant with many long prompts thus gets no more of a step than a tenant with one, and a
//! short request starts in the very next step. Whatever the queue leaves unused goes back to
//! the prompts under way (`Batcher::extend_chunks`), so no budget idles.

/// Max-min fair shares of `budget` for `demands`, in their order; the shares never exceed the
/// demands, and their sum is `budget` unless every demand is met. Integer shares: the units an
/// even split cannot divide go to the earliest parties still short.
pub(super) fn water_fill(budget: u64, demands: &[u64]) -> Vec<u64> {
    // The water level: every demand up to it is met in full, every larger one gets the level.
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by_key(|&i| demands[i]);
    let mut left = budget;
    let mut level = u64::MAX;
    for (served, &i) in order.iter().enumerate() {
        let parties = (demands.len() - served) as u64;
        if demands[i] > left / parties {
            level = left / parties;
            break;
        }
        left -= demands[i];
    }
    let mut shares: Vec<u64> = demands.iter().map(|&demand| demand.min(level)).collect();
    let mut left = budget - shares.iter().sum::<u64>();
    for (share, &demand) in shares.iter_mut().zip(demands) {
        if left == 0 {
            break;
        }
        if *share < demand {
            *share += 1;
            left -= 1;
        }
    }
    shares
}

/// Each prompt under way's share, in the order given, and the waiting queue's.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Shares {
    pub under_way: Vec<u64>,
    pub queue: u64,
}

/// Splits `budget` between `under_way` ((tenant, prompt tokens still to compute), oldest first)
/// and, if requests wait, the queue, whose demand is unbounded (it decides itself what fits).
pub(super) fn share_prefill_budget(
    budget: u64,
    under_way: &[(&str, u64)],
    queue_waiting: bool,
) -> Shares {
    // Tenants in order of their oldest prompt, each with its prompts' indices.
    let mut tenants: Vec<(&str, Vec<usize>)> = Vec::new();
    for (index, (tenant, _)) in under_way.iter().enumerate() {
        match tenants.iter_mut().find(|(name, _)| name == tenant) {
            Some((_, prompts)) => prompts.push(index),
            None => tenants.push((tenant, vec![index])),
        }
    }
    let mut demands: Vec<u64> = tenants
        .iter()
        .map(|(_, prompts)| prompts.iter().map(|&i| under_way[i].1).sum())
        .collect();
    if queue_waiting {
        demands.push(u64::MAX);
    }
    let tenant_shares = water_fill(budget, &demands);
    let mut shares = vec![0; under_way.len()];
    for ((_, prompts), &tenant_share) in tenants.iter().zip(&tenant_shares) {
        let wants: Vec<u64> = prompts.iter().map(|&i| under_way[i].1).collect();
        for (&i, share) in prompts.iter().zip(water_fill(tenant_share, &wants)) {
            shares[i] = share;
        }
    }
    Shares {
        under_way: shares,
        queue: if queue_waiting {
            tenant_shares[tenants.len()]
        } else {
            0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_needs_less_than_an_equal_share_gets_what_it_needs() {
        assert_eq!(water_fill(90, &[10, 100, 100]), vec![10, 40, 40]);
        assert_eq!(water_fill(90, &[5, 5]), vec![5, 5]);
        assert_eq!(water_fill(0, &[5, 5]), vec![0, 0]);
        // 10 cannot be split in three: the earliest parties still short get the units.
        assert_eq!(water_fill(10, &[100, 100, 100]), vec![4, 3, 3]);
        assert_eq!(water_fill(7, &[u64::MAX]), vec![7]);
        assert!(water_fill(5, &[]).is_empty());
    }

    #[test]
    fn waiting_requests_get_a_share_beside_the_prompts_under_way() {
        // Two long prompts of one tenant and a queue: the queue gets half, as a second party.
        let shares = share_prefill_budget(64, &[("", 600), ("", 600)], true);
        assert_eq!(
            shares,
            Shares {
                under_way: vec![16, 16],
                queue: 32
            }
        );
        // Without waiting requests the prompts under way share it all.
        let shares = share_prefill_budget(64, &[("", 600), ("", 600)], false);
        assert_eq!(
            shares,
            Shares {
                under_way: vec![32, 32],
                queue: 0
            }
        );
        // Nothing under way: the queue has the whole budget, as before.
        assert_eq!(share_prefill_budget(64, &[], true).queue, 64);
    }

    #[test]
    fn tenants_share_first_then_their_prompts() {
        // Tenant a has three long prompts, b one short and one long: each tenant gets half.
        let shares = share_prefill_budget(
            96,
            &[("a", 500), ("b", 8), ("a", 500), ("a", 500), ("b", 500)],
            false,
        );
        assert_eq!(shares.under_way, vec![16, 8, 16, 16, 40]);
        assert_eq!(shares.under_way.iter().sum::<u64>(), 96);
    }
}
