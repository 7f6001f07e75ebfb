//! Which part of the work this process does in a multi-process run.
//!
//! Launchers tell each process its place: torchrun and most scripts set `RANK` and
//! `WORLD_SIZE`, Slurm's `srun` sets `SLURM_PROCID` and `SLURM_NTASKS`, Open MPI's `mpirun` sets
//! `OMPI_COMM_WORLD_RANK` and `OMPI_COMM_WORLD_SIZE`. [`Ranks::from_env`] reads the first pair
//! present, in that order. Work items are dealt round-robin: rank `r` of `w` owns item `i`
//! when `i % w == r`, so the ranks' parts are disjoint and together cover everything.

use std::fmt;

/// This process's rank and the number of processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranks {
    /// This process, `0..world_size`.
    pub rank: usize,
    /// How many processes share the work.
    pub world_size: usize,
}

/// The launcher variables, as (rank, world size) pairs, in the order they are looked up.
pub const RANK_VARIABLES: [(&str, &str); 3] = [
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
];

impl Default for Ranks {
    fn default() -> Self {
        Ranks::single()
    }
}

impl fmt::Display for Ranks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world_size)
    }
}

impl Ranks {
    /// One process doing everything.
    pub fn single() -> Self {
        Ranks {
            rank: 0,
            world_size: 1,
        }
    }

    /// A checked rank: `rank < world_size`.
    pub fn new(rank: usize, world_size: usize) -> Result<Self, String> {
        if world_size == 0 || rank >= world_size {
            return Err(format!("rank {rank} is not below world size {world_size}"));
        }
        Ok(Ranks { rank, world_size })
    }

    /// From the launcher variables (see the module docs); one process when none is set.
    pub fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`Ranks::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        for (rank_var, size_var) in RANK_VARIABLES {
            match (get(rank_var), get(size_var)) {
                (None, None) => continue,
                (Some(r), Some(w)) => {
                    let parse = |name: &str, v: &str| {
                        v.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("{name}={v:?} is not a number"))
                    };
                    return Ranks::new(parse(rank_var, &r)?, parse(size_var, &w)?)
                        .map_err(|e| format!("{rank_var}/{size_var}: {e}"));
                }
                (Some(_), None) => return Err(format!("{rank_var} is set but {size_var} is not")),
                (None, Some(_)) => return Err(format!("{size_var} is set but {rank_var} is not")),
            }
        }
        Ok(Ranks::single())
    }

    /// Whether work item `index` is this rank's.
    pub fn owns(&self, index: usize) -> bool {
        index % self.world_size == self.rank
    }

    /// This rank's items of `items`, in order.
    pub fn share<T>(&self, items: impl IntoIterator<Item = T>) -> Vec<T> {
        items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| self.owns(*i))
            .map(|(_, item)| item)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_variables_are_read_in_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Ranks::from_lookup(env(&[])).unwrap(), Ranks::single());
        assert_eq!(
            Ranks::from_lookup(env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])).unwrap(),
            Ranks::new(3, 4).unwrap()
        );
        assert_eq!(
            Ranks::from_lookup(env(&[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
            ]))
            .unwrap(),
            Ranks::single()
        );
        assert!(
            Ranks::from_lookup(env(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .contains("not below")
        );
        assert!(
            Ranks::from_lookup(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .contains("not a number")
        );
        assert!(
            Ranks::from_lookup(env(&[("RANK", "0")]))
                .unwrap_err()
                .contains("WORLD_SIZE is not")
        );
    }

    #[test]
    fn shares_are_disjoint_and_cover_everything() {
        let items: Vec<usize> = (0..11).collect();
        let mut all: Vec<usize> = (0..3)
            .flat_map(|r| Ranks::new(r, 3).unwrap().share(items.clone()))
            .collect();
        all.sort();
        assert_eq!(all, items);
        assert_eq!(Ranks::new(1, 3).unwrap().share(items), vec![1, 4, 7, 10]);
    }
}
