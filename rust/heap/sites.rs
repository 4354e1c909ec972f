//! Allocation sites: where sampled blocks were allocated, a task prefix and the Python
//! stack the allocating thread walked itself (`OwnFrames`), named later by the sampling
//! thread (`take_unnamed`, `name`). Each site sums the blocks charged to it.

use super::live::Totals;
use crate::profile::model::Frame;
use crate::reader::{OwnFrames, RawStack};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::Arc;

/// Sites kept at most; past it, a sample counts for its prefix without a stack.
const MAX_SITES: usize = 1 << 12;
/// A block without a site: its stack was not walked, or the sites were full.
pub const NO_SITE: u32 = u32::MAX;

/// Notes of rows without frames.
pub const NOT_NAMED_YET: &str = "stack not named yet";
pub const UNREADABLE: &str = "stack unreadable";
pub const SMALLER: &str = "smaller stacks";
pub const NO_STACK: &str = "no stack kept";
pub const ARROW: &str = "arrow's pool";

/// A site's estimates: bytes and objects allocated, and in use now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SiteTotals {
    pub allocated: f64,
    pub in_use: f64,
    pub allocated_objects: f64,
    pub in_use_objects: f64,
}

impl SiteTotals {
    fn add(&mut self, t: &SiteTotals) {
        self.allocated += t.allocated;
        self.in_use += t.in_use;
        self.allocated_objects += t.allocated_objects;
        self.in_use_objects += t.in_use_objects;
    }
}

/// A site's prefix id and the (code, instruction) pairs of its stack.
type SiteKey = (u32, Box<[(u64, u64)]>);

struct Site {
    prefix: u32,
    /// The stack as walked, until the sampling thread takes it to name it.
    stack: Option<RawStack>,
    /// Its frames, innermost first, once named (empty: they could not be).
    frames: Option<Arc<[Frame]>>,
    totals: SiteTotals,
}

/// One site's estimates, its frames root first; a row without frames stands for what
/// `note` says.
#[derive(Debug, Serialize)]
pub struct SiteRow {
    pub prefix: Option<Arc<str>>,
    pub frames: Vec<Frame>,
    pub note: Option<&'static str>,
    #[serde(flatten)]
    pub totals: SiteTotals,
}

#[derive(Default)]
pub struct Sites {
    /// Walks the allocating thread's stack; None where no reader can name it.
    walker: Option<OwnFrames>,
    sites: Vec<Site>,
    ids: FxHashMap<SiteKey, u32>,
    /// Sites whose stacks wait to be named.
    unnamed: Vec<u32>,
}

impl Sites {
    pub fn new(walker: Option<OwnFrames>) -> Sites {
        Sites { walker, ..Sites::default() }
    }

    /// Walks no more stacks: blocks from now on get no site.
    pub fn stop_walking(&mut self) {
        self.walker = None;
    }

    /// The site of an allocation the calling thread makes now for prefix id `prefix`.
    pub fn here(&mut self, prefix: u32) -> u32 {
        let Some(stack) = self.walker.as_mut().and_then(OwnFrames::walk) else { return NO_SITE };
        let key = (prefix, stack.frames.iter().map(|f| (f.code, f.instr)).collect());
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        if self.sites.len() >= MAX_SITES {
            return NO_SITE;
        }
        let id = self.sites.len() as u32;
        self.sites.push(Site { prefix, stack: Some(stack), frames: None, totals: SiteTotals::default() });
        self.ids.insert(key, id);
        self.unnamed.push(id);
        id
    }

    /// A block standing for `held_bytes` and `objects` was charged to `site`, which
    /// allocated `allocated` bytes with it (0: a block put back after a failed realloc).
    pub fn add(&mut self, site: u32, allocated: f64, held_bytes: f64, objects: f64) {
        if let Some(site) = self.sites.get_mut(site as usize) {
            let t = &mut site.totals;
            t.allocated += allocated;
            t.allocated_objects += if allocated > 0.0 { objects } else { 0.0 };
            t.in_use += held_bytes;
            t.in_use_objects += objects;
        }
    }

    /// A block of `site` was freed.
    pub fn remove(&mut self, site: u32, held_bytes: f64, objects: f64) {
        if let Some(site) = self.sites.get_mut(site as usize) {
            let t = &mut site.totals;
            t.in_use = (t.in_use - held_bytes).max(0.0);
            t.in_use_objects = (t.in_use_objects - objects).max(0.0);
        }
    }

    /// Whether a site waits to be named.
    pub fn waiting(&self) -> bool {
        !self.unnamed.is_empty()
    }

    /// The sites whose stacks wait to be named, each with its stack (taken out).
    pub fn take_unnamed(&mut self) -> Vec<(u32, RawStack)> {
        let ids = std::mem::take(&mut self.unnamed);
        ids.into_iter().filter_map(|id| Some((id, self.sites[id as usize].stack.take()?))).collect()
    }

    /// Names sites, frames innermost first (None: they could not be named).
    pub fn name(&mut self, named: impl IntoIterator<Item = (u32, Option<Vec<Frame>>)>) {
        for (id, frames) in named {
            if let Some(site) = self.sites.get_mut(id as usize) {
                site.frames = Some(frames.unwrap_or_default().into());
            }
        }
    }

    /// The sites as rows, most in use first (then most allocated); sites whose stacks
    /// read alike (they differ in instructions of one line) are one row. Past `most`
    /// rows, a prefix's others are summed as one; so are what arrow's pool grew by while
    /// it ran, and what its sites do not hold of its `totals` (by prefix id). `name`: a
    /// prefix id's name.
    pub fn rows(&self, most: usize, totals: &[Totals], name: impl Fn(u32) -> Option<Arc<str>>) -> Vec<SiteRow> {
        let mut alike: FxHashMap<(u32, Option<&[Frame]>), SiteTotals> = FxHashMap::default();
        for site in self.sites.iter().filter(|s| s.totals.allocated > 0.0) {
            alike.entry((site.prefix, site.frames.as_deref())).or_default().add(&site.totals);
        }
        let mut groups: Vec<_> = alike.into_iter().collect();
        groups.sort_by(|(_, a), (_, b)| b.in_use.total_cmp(&a.in_use).then(b.allocated.total_cmp(&a.allocated)));
        let mut rest: Vec<(SiteTotals, SiteTotals)> = vec![Default::default(); totals.len()];
        let mut rows = Vec::new();
        for (n, ((prefix, frames), sum)) in groups.into_iter().enumerate() {
            let (smaller, all) = &mut rest[prefix as usize];
            all.add(&sum);
            if n >= most {
                smaller.add(&sum);
                continue;
            }
            let (frames, note) = match frames {
                None => (Vec::new(), Some(NOT_NAMED_YET)),
                Some([]) => (Vec::new(), Some(UNREADABLE)),
                Some(f) => (f.iter().rev().cloned().collect(), None),
            };
            rows.push(SiteRow { prefix: name(prefix), frames, note, totals: sum });
        }
        for (prefix, ((smaller, all), t)) in rest.into_iter().zip(totals).enumerate() {
            let arrow = SiteTotals { allocated: t.arrow_allocated, in_use: t.arrow_in_use, ..Default::default() };
            let untracked = SiteTotals {
                allocated: t.allocated - all.allocated - arrow.allocated,
                in_use: t.in_use - all.in_use - arrow.in_use,
                ..Default::default()
            };
            for (totals, note) in [(smaller, SMALLER), (arrow, ARROW), (untracked, NO_STACK)] {
                if totals.allocated > 1.0 || totals.in_use > 1.0 {
                    rows.push(SiteRow { prefix: name(prefix as u32), frames: Vec::new(), note: Some(note), totals });
                }
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_alike_are_one_row_and_past_the_most_are_summed_per_prefix() {
        let frames = |names: &[&str]| -> Arc<[Frame]> {
            names.iter().map(|n| Frame::python(n.to_string(), "job.py".into(), 1)).collect()
        };
        let totals = |in_use: f64| SiteTotals { allocated: 2.0 * in_use, in_use, ..SiteTotals::default() };
        let site =
            |prefix, frames: Option<Arc<[Frame]>>, in_use| Site { prefix, stack: None, frames, totals: totals(in_use) };
        let (outside, load) = (0, 1);
        let sites = Sites {
            sites: vec![
                site(load, Some(frames(&["read", "main"])), 100.0), // innermost first
                site(load, Some(frames(&["read", "main"])), 50.0),  // another instruction of the same lines
                site(load, Some(frames(&["parse", "main"])), 30.0),
                site(load, None, 5.0),
                site(outside, Some(frames(&[])), 7.0),
            ],
            ..Sites::default()
        };
        let by_prefix = [Totals::new(14.0, 7.0, 7.0), Totals::new(400.0, 200.0, 200.0)];
        let name = |id: u32| (id == load).then(|| Arc::from("load"));
        let rows = sites.rows(2, &by_prefix, name);
        let shown: Vec<_> = rows
            .iter()
            .map(|r| {
                (
                    r.prefix.as_deref(),
                    r.frames.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
                    r.note,
                    r.totals.in_use,
                )
            })
            .collect();
        assert_eq!(
            shown,
            [
                (Some("load"), vec!["main", "read"], None, 150.0),
                (Some("load"), vec!["main", "parse"], None, 30.0),
                (None, vec![], Some(SMALLER), 7.0),
                (Some("load"), vec![], Some(SMALLER), 5.0),
                (Some("load"), vec![], Some(NO_STACK), 15.0),
            ]
        );
        let all = sites.rows(usize::MAX, &by_prefix, name);
        assert!(all.iter().any(|r| r.note == Some(NOT_NAMED_YET)) && all.iter().any(|r| r.note == Some(UNREADABLE)));
    }
}
