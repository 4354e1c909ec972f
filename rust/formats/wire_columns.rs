//! Samples on the wire: a protobuf column per field, times as differences (mostly 0
//! or one tick), optional columns empty where every sample has the default.

use crate::profile::sample::Sample;

/// Samples, a column per field; tags and activities + 1 (0: none).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Columns {
    /// Each sample's time minus the previous one's: mostly 0 or one tick.
    #[prost(sint64, repeated, tag = "1")]
    time_delta_ns: Vec<i64>,
    #[prost(uint32, repeated, tag = "2")]
    thread: Vec<u32>,
    #[prost(uint32, repeated, tag = "3")]
    stack: Vec<u32>,
    #[prost(uint32, repeated, tag = "4")]
    tag: Vec<u32>,
    #[prost(uint32, repeated, tag = "5")]
    weight_us: Vec<u32>,
    #[prost(uint32, repeated, tag = "6")]
    cpu_us: Vec<u32>,
    /// Empty: every sample counts once.
    #[prost(uint32, repeated, tag = "7")]
    count: Vec<u32>,
    #[prost(uint32, repeated, tag = "8")]
    flags: Vec<u32>,
    /// Empty: no sample has one.
    #[prost(uint32, repeated, tag = "9")]
    activity: Vec<u32>,
    /// Empty: no sample stands for a stretch (`Sample::cover`).
    #[prost(uint32, repeated, tag = "10")]
    cover: Vec<u32>,
}

impl Columns {
    pub fn of(samples: &[Sample]) -> Columns {
        let mut c = Columns::default();
        let mut last = 0i64;
        for s in samples {
            c.time_delta_ns.push(s.time_ns as i64 - last);
            last = s.time_ns as i64;
            c.thread.push(s.thread);
            c.stack.push(s.stack);
            c.tag.push(s.tag.map_or(0, |t| t + 1));
            c.weight_us.push(s.weight_us);
            c.cpu_us.push(s.cpu_us);
            c.flags.push(s.flags.into());
        }
        if samples.iter().any(|s| s.activity.is_some()) {
            c.activity = samples.iter().map(|s| s.activity.map_or(0, |a| a + 1)).collect();
        }
        if samples.iter().any(|s| s.count != 1) {
            c.count = samples.iter().map(|s| s.count).collect();
        }
        if samples.iter().any(|s| s.cover != 0) {
            c.cover = samples.iter().map(|s| s.cover.into()).collect();
        }
        c
    }

    pub fn samples(self) -> Result<Vec<Sample>, String> {
        let c = self;
        let n = c.time_delta_ns.len();
        same_lengths(&[
            n,
            c.thread.len(),
            c.stack.len(),
            c.tag.len(),
            c.weight_us.len(),
            c.cpu_us.len(),
            c.flags.len(),
        ])?;
        if [c.count.len(), c.activity.len(), c.cover.len()].iter().any(|&l| l != 0 && l != n) {
            return Err("columns differ in length".into());
        }
        let mut time = 0i64;
        let samples = (0..n).map(|i| {
            time = time.wrapping_add(c.time_delta_ns[i]);
            Sample {
                time_ns: time as u64,
                thread: c.thread[i],
                stack: c.stack[i],
                tag: c.tag[i].checked_sub(1),
                activity: c.activity.get(i).and_then(|a| a.checked_sub(1)),
                weight_us: c.weight_us[i],
                cpu_us: c.cpu_us[i],
                count: c.count.get(i).copied().unwrap_or(1),
                flags: c.flags[i] as u8,
                cover: c.cover.get(i).map_or(0, |&c| c.min(u16::MAX.into()) as u16),
            }
        });
        Ok(samples.collect())
    }
}

pub fn same_lengths(lengths: &[usize]) -> Result<(), String> {
    match lengths.windows(2).all(|w| w[0] == w[1]) {
        true => Ok(()),
        false => Err("columns differ in length".into()),
    }
}
