//! Which samples a `span=` request keeps. A name keeps every span with that name
//! on its path, so the spans nested in them too; a span id keeps that span and the
//! spans nested in it; a path (outermost first) keeps the spans whose path starts
//! with it. Samples outside any span (or any task) are never kept.

use crate::profile::model::{ProfileData, Tag};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpanFilter {
    /// A span name or id.
    One(String),
    Path(Vec<String>),
}

impl SpanFilter {
    pub fn keeps(&self, data: &ProfileData, tag: &Tag) -> bool {
        let Some(id) = &tag.span else { return false };
        let span = data.spans.get(id);
        match self {
            // A span the scheduler did not name goes by its id.
            SpanFilter::One(one) => id == one || span.is_some_and(|s| s.names.contains(one) || s.ids.contains(one)),
            SpanFilter::Path(path) => span.map_or([id.clone()].starts_with(path), |s| s.names.starts_with(path)),
        }
    }

    /// The samples of `data` this filter keeps.
    pub fn select(&self, data: &ProfileData) -> ProfileData {
        let keep: Vec<bool> = data.tags.iter().map(|t| self.keeps(data, t)).collect();
        data.filtered(|s| s.tag.is_some_and(|t| keep[t as usize]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;

    fn names(p: &ProfileData) -> Vec<String> {
        p.samples.iter().map(|s| p.frames[*p.stacks[s.stack as usize].last().unwrap() as usize].name.clone()).collect()
    }

    #[test]
    fn names_ids_and_paths_keep_nested_spans() {
        let mut data = profile(
            "w",
            &[(1, &["f"], Some("f-1")), (1, &["g"], Some("g-1")), (1, &["h"], Some("h-1")), (1, &["i"], None)],
        );
        let span = |names: &[&str], ids: &[&str]| Span {
            names: names.iter().map(|n| n.to_string()).collect(),
            ids: ids.iter().map(|n| n.to_string()).collect(),
        };
        data.spans.insert("a".into(), span(&["load"], &["a"]));
        data.spans.insert("b".into(), span(&["load", "parse"], &["a", "b"]));
        data.tags[0].span = Some("a".into());
        data.tags[1].span = Some("b".into());
        data.tags[2].span = Some("forgotten".into());
        let select = |f: SpanFilter| names(&f.select(&data));
        assert_eq!(select(SpanFilter::One("load".into())), ["f", "g"]);
        assert_eq!(select(SpanFilter::One("parse".into())), ["g"]);
        assert_eq!(select(SpanFilter::One("a".into())), ["f", "g"], "an id keeps the spans nested in it");
        assert_eq!(select(SpanFilter::One("forgotten".into())), ["h"]);
        assert_eq!(select(SpanFilter::Path(vec!["load".into(), "parse".into()])), ["g"]);
        assert!(select(SpanFilter::Path(vec!["parse".into()])).is_empty(), "a path starts at the outermost span");
        let kept = SpanFilter::One("load".into()).select(&data);
        assert_eq!(kept.processes, data.processes);
        assert_eq!(kept.spans, data.spans);
        assert!(kept.validate().is_ok());
    }
}
