//! Property tests: any text in frame names, files, task keys or thread names
//! survives the exporters and loaders (valid JSON, exact round trip) and never
//! becomes markup.

use crate::formats::limits::tests::LOOSE;
use crate::formats::{diff, files, flamegraph, speedscope, speedscope_read};
use crate::profile::model::{tests::profile, Frame, Tag};
use crate::profile::summary;
use crate::profile::views::{By, Shown, Weight};
use proptest::prelude::*;

fn hostile() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<script>alert(1)</script>".to_string()),
        Just("\"';\n\r\0&amp;</svg>]]>".to_string()),
        Just("x".repeat(100_000)),
        any::<String>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn exporters_survive_any_names(name in hostile(), file in hostile(), key in hostile(), thread in hostile()) {
        let mut data = profile("w", &[(1, &["main", "f"], Some("k")), (1, &["main", "g"], None)]);
        data.frames[1] = Frame::python(name.clone(), file.clone(), 3);
        data.tags[0] = Tag { key: key.clone(), prefix: key.clone(), span: Some(key.clone()) };
        data.threads[0].name = Some(thread.clone());
        for by in [By::Thread, By::Task, By::Prefix, By::Span] {
            let written = speedscope::write(&data, Shown { by, weight: Weight::Wall }, "t");
            let doc: serde_json::Value = serde_json::from_slice(&written).unwrap();
            let frames = doc["shared"]["frames"].as_array().unwrap();
            prop_assert!(frames.iter().any(|f| f["name"] == name.as_str() && f["file"] == file.as_str()));
            if by == By::Task {
                prop_assert!(frames.iter().any(|f| f["name"] == key.as_str()));
            }
            let profiles = doc["profiles"].as_array().unwrap();
            prop_assert!(profiles.iter().any(|p| p["name"].as_str().unwrap().contains(thread.as_str())));
            let shown = Shown { by, weight: Weight::Wall };
            let (back, _) = speedscope_read::read(&speedscope::write(&data, shown, "t"), LOOSE).unwrap();
            prop_assert!(back.frames.contains(&data.frames[1]) && back.threads.contains(&data.threads[0]));
            prop_assert_eq!(files::read(&files::write(&data, by), LOOSE).unwrap(), (data.clone(), by));
            let svg = flamegraph::svg(&data, &key, shown, data.samples.iter()).unwrap();
            let diffed = diff::diff(&data, &data).svg.unwrap();
            for svg in [svg, diffed] {
                prop_assert_eq!(svg.matches("<script").count(), 2, "only the graph's own scripts");
                prop_assert!(!svg.chars().any(|c| c < ' ' && !matches!(c, '\t' | '\n' | '\r')), "valid XML text");
            }
        }
        let s = summary::summarize(&data);
        prop_assert_eq!(&s.prefixes[0].prefix, &key);
    }
}
