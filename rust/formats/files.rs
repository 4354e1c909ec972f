//! Our own lossless profile file, `.pyspy.gz`: gzip JSON of
//! `{"format": "dask-pyspy profile", "version": 1, "by": "prefix", "profile": ...}`,
//! where `profile` is the profile's JSON form (`model.rs`), so every sample, tag,
//! span, process and metadata entry loads back as it was. `format` and `version`
//! keep their meaning in every version, so a reader can say what a file is before
//! it parses the rest.

use crate::error::Error;
use crate::formats::compress;
use crate::formats::limits::{raw_field, Limits};
use crate::profile::model::ProfileData;
use crate::profile::views::By;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

pub const FORMAT: &str = "dask-pyspy profile";
pub const VERSION: u64 = 1;

#[derive(Serialize)]
struct Written<'a> {
    format: &'static str,
    version: u64,
    by: &'static str,
    profile: &'a ProfileData,
}

/// Every field optional, so a foreign JSON document gets a message, not serde's.
#[derive(Deserialize)]
struct Read<'a> {
    format: Option<Value>,
    version: Option<Value>,
    by: Option<String>,
    #[serde(borrow)]
    profile: Option<&'a RawValue>,
}

pub fn write(data: &ProfileData, by: By) -> Vec<u8> {
    let file = Written { format: FORMAT, version: VERSION, by: by.as_str(), profile: data };
    compress::kept(&serde_json::to_vec(&file).expect("profiles serialise"))
}

/// The profile and the grouping it was saved with; the version is checked before
/// the profile is parsed, since another version may lay it out differently.
pub fn read(bytes: &[u8], limits: Limits) -> Result<(ProfileData, By), Error> {
    parse(bytes, limits).map_err(Error::BadInput)
}

fn parse(bytes: &[u8], limits: Limits) -> Result<(ProfileData, By), String> {
    let json = limits.gunzip(bytes)?;
    let not_ours = |e: &dyn std::fmt::Display| format!("not a dask-pyspy profile file ({e})");
    let json = std::str::from_utf8(&json).map_err(|e| not_ours(&e))?;
    limits.check_parse(json, raw_field(json, &["profile", "samples"]))?;
    let file: Read = serde_json::from_str(json).map_err(|e| not_ours(&e))?;
    if file.format.as_ref().and_then(Value::as_str) != Some(FORMAT) {
        return Err(format!("not a dask-pyspy profile file (no \"format\": \"{FORMAT}\")"));
    }
    match file.version.as_ref().and_then(Value::as_u64) {
        Some(VERSION) => {}
        Some(v) => {
            let whose = if v > VERSION { "a newer" } else { "an older" };
            return Err(format!(
                "file format version {v} (written by {whose} dask-pyspy); dask-pyspy {} reads version {VERSION} only",
                env!("CARGO_PKG_VERSION")
            ));
        }
        None => return Err(format!("no valid file format version: {}", file.version.unwrap_or(Value::Null))),
    }
    let by: By = file.by.ok_or("no \"by\" grouping")?.parse().map_err(|e: Error| e.to_string())?;
    let profile = file.profile.ok_or("no \"profile\"")?;
    let data: ProfileData = serde_json::from_str(profile.get()).map_err(|e| format!("a damaged profile ({e})"))?;
    data.validate().map_err(|e| format!("a damaged profile ({e})"))?;
    Ok((data, by))
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::formats::limits::tests::LOOSE;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;
    use flate2::Compression;
    use proptest::prelude::*;
    use serde_json::json;

    fn read(bytes: &[u8]) -> Result<(ProfileData, By), String> {
        super::parse(bytes, LOOSE)
    }

    /// Two processes, tags with and without spans, large times and idents, float stats.
    pub fn rich() -> ProfileData {
        let a = profile("w1", &[(1, &["main", "f"], Some("f-1")), (u64::MAX, &["main", "g"], None)]);
        let b = profile("w2", &[(7, &["main", "f"], Some("f-2"))]);
        let mut data = ProfileData::merge(
            &[&a, &b],
            serde_json::from_value(json!({"window": [1.5, 2.25], "tasks": {"w1": {"f": {"count": 3}}}})).unwrap(),
        );
        data.tags[0].span = Some("s1".into());
        data.activities = vec!["scheduler: task-finished".into()];
        data.samples[1].activity = Some(0);
        data.spans.insert("s1".into(), Span { names: vec!["load".into()], ids: vec!["s1".into()] });
        data.samples[0].time_ns = 1_700_000_000_123_456_789;
        data.samples[1].cpu_us = 4321;
        data.samples[1].cover = 42; // a folded row's part
        data.processes[1].stats = json!({"achieved_rate": 99.999_999_123, "tiny": 1e-300});
        data
    }

    fn with_version(version: Value) -> Vec<u8> {
        let mut doc: Value = serde_json::from_slice(&LOOSE.gunzip(&write(&rich(), By::Task)).unwrap()).unwrap();
        doc["version"] = version;
        compress::gzip(&serde_json::to_vec(&doc).unwrap(), Compression::fast())
    }

    #[test]
    fn round_trips_exactly() {
        let data = rich();
        let (back, by) = read(&write(&data, By::Task)).unwrap();
        assert_eq!(back, data);
        assert_eq!(by, By::Task);
        let aggregated = data.aggregated(false);
        assert!(!aggregated.timeline.is_empty());
        assert_eq!(read(&write(&aggregated, By::Task)).unwrap().0, aggregated, "with its timeline cells");
    }

    #[test]
    fn another_version_names_both() {
        let err = read(&with_version(json!(2))).unwrap_err();
        assert!(
            err.contains("version 2 (written by a newer dask-pyspy)") && err.contains("reads version 1 only"),
            "{err}"
        );
        assert!(read(&with_version(json!(0))).unwrap_err().contains("an older"));
        assert!(read(&with_version(json!("1"))).unwrap_err().contains("no valid file format version: \"1\""));
    }

    #[test]
    fn foreign_and_damaged_files_are_named() {
        let file = write(&rich(), By::Prefix);
        assert_eq!(read(b"random bytes").unwrap_err(), "not gzip-compressed");
        assert!(read(&file[..file.len() / 2]).unwrap_err().starts_with("a truncated or corrupt gzip file"));
        assert!(
            read(&file[..file.len() - 3]).unwrap_err().starts_with("a truncated or corrupt gzip file"),
            "a cut trailer"
        );
        let foreign =
            |v: Value| read(&compress::gzip(&serde_json::to_vec(&v).unwrap(), Compression::fast())).unwrap_err();
        assert!(foreign(json!({"a": 1})).contains("no \"format\""));
        assert!(foreign(json!([1, 2])).starts_with("not a dask-pyspy profile file"));
        assert!(foreign(json!({"format": FORMAT, "version": 1, "by": "task", "profile": {"frames": []}}))
            .starts_with("a damaged profile"));
        let mut dangling = rich();
        dangling.samples[0].stack = 99;
        assert!(read(&write(&dangling, By::Thread))
            .unwrap_err()
            .contains("a sample names a thread, stack, tag or activity that does not exist"));
    }

    #[test]
    fn a_file_is_read_within_its_limits() {
        let bomb = compress::gzip(&vec![b' '; 1 << 20], Compression::best());
        assert!(super::parse(&bomb, Limits { json: 1 << 19, memory: 1 << 30 })
            .unwrap_err()
            .starts_with("it decompresses to more than"));
        let objects = vec![r#"{"a":0}"#; 10_000].join(",");
        let doc = format!(
            r#"{{"format": "{FORMAT}", "version": 1, "by": "thread", "profile": {{"metadata": {{"x": [{objects}]}}}}}}"#
        );
        let e = super::parse(
            &compress::gzip(doc.as_bytes(), Compression::fast()),
            Limits { json: 1 << 20, memory: 1 << 22 },
        )
        .unwrap_err();
        assert!(e.starts_with("parsing its JSON could take"), "{e}");
        // Sample columns count as what they take, not as `Value`s would.
        let stacks: Vec<(u64, &[&str], Option<&str>)> = vec![(1, &["main", "f"], None); 100_000];
        let file = write(&profile("w", &stacks), By::Thread);
        let limits = Limits { json: 1 << 30, memory: 6 << 20 };
        let json = String::from_utf8(limits.gunzip(&file).unwrap()).unwrap();
        assert!(limits.check_parse(&json, None).is_err(), "as values the columns would not fit");
        assert_eq!(super::parse(&file, limits).unwrap().0.samples.len(), 100_000);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A cut or damaged file is an error, never a panic or a different profile.
        #[test]
        fn damage_never_panics(cut in 0usize..10_000, flip in 0usize..10_000, bit in 0u8..8) {
            let file = write(&rich(), By::Prefix);
            let cut = cut % file.len();
            prop_assert!(read(&file[..cut]).is_err());
            let mut damaged = file.clone();
            damaged[flip % file.len()] ^= 1 << bit;
            if let Ok((back, _)) = read(&damaged) {
                prop_assert_eq!(back, rich(), "gzip's CRC lets no changed profile through");
            }
        }
    }
}
