//! Flame graph SVG (inferno) over any subset of a profile's samples, as `views` shows them.

use crate::profile::intern::Interner;
use crate::profile::model::{Frame, ProfileData};
use crate::profile::sample::{Sample, FLAG_STALL};
use crate::profile::spans::SpanFilter;
use crate::profile::views::{By, Shown, View};
use inferno::flamegraph::color::{Color, PaletteMap};
use inferno::flamegraph::{self, Options};
use std::collections::HashMap;

/// Characters XML 1.0 forbids (a NUL would make the browser reject the whole SVG).
fn xml_safe(text: &str) -> String {
    text.chars()
        .map(|c| if (c < ' ' && c != '\t') || c == '\u{FFFE}' || c == '\u{FFFF}' { '\u{FFFD}' } else { c })
        .collect()
}

/// `text` safe in a folded stack: the characters that delimit one replaced.
pub fn clean(text: &str) -> String {
    xml_safe(&text.replace([';', '\n', '\r'], " "))
}

/// `name (file.py:12)`, or `name (file.py)` without `lines`.
pub fn label(f: &Frame, lines: bool) -> String {
    let file = f.file.rsplit('/').next().unwrap_or(&f.file);
    clean(&if lines && f.line > 0 {
        format!("{} ({}:{})", f.name, file, f.line)
    } else {
        format!("{} ({})", f.name, file)
    })
}

/// Each tag's and activity's roots as `by` shows them, as ids that equal roots share:
/// samples fold by what the graph shows, so a thousand processes' keys of one prefix
/// make one line per stack, not a thousand to be joined and merged as strings.
struct RootIds {
    of_tag: Vec<u32>,
    of_activity: Vec<u32>,
    of_none: u32,
    roots: Vec<Vec<String>>,
}

impl RootIds {
    fn new<'a>(data: &'a ProfileData, view: &View<'a>, by: By) -> RootIds {
        let mut ids: Interner<Vec<&'a str>> = Interner::default();
        let of_tag = (0..data.tags.len() as u32).map(|t| ids.intern(view.roots(Some(t), None, by))).collect();
        let of_activity =
            (0..data.activities.len() as u32).map(|a| ids.intern(view.roots(None, Some(a), by))).collect();
        let of_none = ids.intern(view.roots(None, None, by));
        let roots = ids.into_items().into_iter().map(|names| names.into_iter().map(clean).collect()).collect();
        RootIds { of_tag, of_activity, of_none, roots }
    }

    fn of(&self, s: &Sample) -> u32 {
        match (s.tag, s.activity) {
            (Some(t), _) => self.of_tag[t as usize],
            (None, Some(a)) => self.of_activity[a as usize],
            (None, None) => self.of_none,
        }
    }
}

/// Folded stacks (`root;...;leaf microseconds`), one line per distinct stack as
/// `view` shows it: grouped `by` task, prefix or span (tagged stacks then cut to the
/// task's own code), recursion folded; frames by function alone without `lines`.
pub fn folded<'s>(
    data: &ProfileData,
    shown: Shown,
    samples: impl Iterator<Item = &'s Sample>,
    lines: bool,
) -> Vec<String> {
    let view = View::new(data);
    let by = shown.by;
    let roots = RootIds::new(data, &view, by);
    let mut weights: HashMap<(u32, u32, bool), u64> = HashMap::new();
    for s in samples {
        let cut = by != By::Thread && s.tag.is_some();
        *weights.entry((roots.of(s), s.stack, cut)).or_default() += shown.weight.of(s) as u64;
    }
    let labels: Vec<String> = data.frames.iter().map(|f| label(f, lines)).collect();
    let mut lines: HashMap<String, u64> = HashMap::new();
    for ((root, stack, cut), w) in weights.into_iter().filter(|&(_, w)| w > 0) {
        let frames = view.folded(view.frames(stack, cut));
        let names: Vec<&str> = roots.roots[root as usize]
            .iter()
            .map(String::as_str)
            .chain(frames.iter().map(|&f| labels[f as usize].as_str()))
            .collect();
        *lines.entry(names.join(";")).or_default() += w;
    }
    let mut lines: Vec<String> = lines.into_iter().map(|(stack, w)| format!("{stack} {w}")).collect();
    lines.sort();
    lines
}

/// inferno's script records zoom and search in the page URL; a graph embedded in a
/// report's frame has an opaque origin where that throws, so it is switched off.
const EMBED_SHIM: &str = "<script type=\"text/ecmascript\"><![CDATA[history.replaceState = function () {};]]></script>";

const MIN_WIDTH_PERCENT: f64 = 0.1;

/// Which samples a flame graph shows; None keeps any. `tasks`: True keeps task
/// samples only, False the rest. `activity`: samples outside tasks in that activity.
#[derive(Default)]
pub struct Only {
    pub prefix: Option<String>,
    pub process: Option<u32>,
    pub tasks: Option<bool>,
    pub span: Option<SpanFilter>,
    pub activity: Option<String>,
    /// Only samples inside event-loop stalls (`FLAG_STALL`).
    pub stalls: bool,
}

/// The flame graph of the samples `only` keeps.
pub fn svg_of(data: &ProfileData, title: &str, shown: Shown, only: &Only) -> Option<String> {
    // Decided once per tag, thread and activity, so a sample costs a few lookups: a
    // report draws dozens of graphs, each over every sample of a 1000-worker profile.
    let tag_ok: Vec<bool> = data
        .tags
        .iter()
        .map(|t| {
            only.prefix.as_ref().is_none_or(|p| t.prefix == *p) && only.span.as_ref().is_none_or(|f| f.keeps(data, t))
        })
        .collect();
    let thread_ok: Vec<bool> = data.threads.iter().map(|t| only.process.is_none_or(|p| t.process == p)).collect();
    let activity_ok: Vec<bool> =
        data.activities.iter().map(|a| only.activity.as_ref().is_none_or(|want| want == a)).collect();
    let keep = |s: &Sample| {
        thread_ok[s.thread as usize]
            && (!only.stalls || s.flags & FLAG_STALL != 0)
            && match s.tag {
                Some(t) => only.tasks != Some(false) && only.activity.is_none() && tag_ok[t as usize],
                None => {
                    only.tasks != Some(true)
                        && only.prefix.is_none()
                        && only.span.is_none()
                        && (only.activity.is_none() || s.activity.is_some_and(|a| activity_ok[a as usize]))
                }
            }
    };
    svg(data, title, shown, data.samples.iter().filter(|s| keep(s)))
}

/// An interactive SVG (click to zoom, search) of `samples`; None when there are none.
pub fn svg<'s>(
    data: &ProfileData,
    title: &str,
    shown: Shown,
    samples: impl Iterator<Item = &'s Sample>,
) -> Option<String> {
    let lines = folded(data, shown, samples, true);
    render(lines.iter().map(String::as_str), title, "μs", false, native_palette(data).as_mut())
}

/// Blues for native frames, apart from the warm colours of Python's; None without any.
fn native_palette(data: &ProfileData) -> Option<PaletteMap> {
    let mut palette = PaletteMap::default();
    for f in data.frames.iter().filter(|f| f.native) {
        let label = label(f, true);
        // A shade per name, steady from graph to graph.
        let shade = label.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
        let color =
            Color { r: 70 + (shade % 50) as u8, g: 130 + (shade / 50 % 60) as u8, b: 225 + (shade / 3000 % 30) as u8 };
        palette.insert(label, color);
    }
    let any = palette.iter().next().is_some();
    any.then_some(palette)
}

/// The graphs of `processes` (distinct indices, with titles), each as `svg_of` draws one
/// process, from one pass over the samples: a graph each read every sample once per process.
pub fn process_svgs(data: &ProfileData, shown: Shown, processes: &[(u32, String)]) -> Vec<Option<String>> {
    let mut slot = vec![None; data.processes.len()];
    for (i, &(p, _)) in processes.iter().enumerate() {
        if let Some(s) = slot.get_mut(p as usize) {
            *s = Some(i);
        }
    }
    let mut samples: Vec<Vec<&Sample>> = vec![Vec::new(); processes.len()];
    for s in &data.samples {
        if let Some(&Some(i)) = slot.get(data.threads[s.thread as usize].process as usize) {
            samples[i].push(s);
        }
    }
    processes.iter().zip(samples).map(|((_, title), samples)| svg(data, title, shown, samples.into_iter())).collect()
}

/// The SVG of folded lines counted in `unit`, with a second count per line for a
/// differential graph (red: the second grew; blue: shrank; reversed by `negate`),
/// frames named in `palette` in its colours; None without samples.
pub fn render<'a>(
    lines: impl IntoIterator<Item = &'a str>,
    title: &str,
    unit: &str,
    negate: bool,
    palette: Option<&mut PaletteMap>,
) -> Option<String> {
    let mut opts = Options::default();
    opts.palette_map = palette;
    opts.title = xml_safe(title);
    opts.count_name = unit.into();
    opts.deterministic = true;
    // Frames under this share of the graph are slivers without a label; left out,
    // a rare deep stack no longer sets the graph's height.
    opts.min_width = MIN_WIDTH_PERCENT;
    // Roots on top (an icicle): the wide frames that matter show first, and a deep
    // stack runs down into the frame's scroll instead of pushing them off the page.
    opts.direction = flamegraph::Direction::Inverted;
    opts.negate_differentials = negate;
    // A narrow frame keeps its function and loses its file, not the other way round.
    opts.text_truncate_direction = flamegraph::TextTruncateDirection::Right;
    let mut out = Vec::new();
    // inferno refuses lines without samples (an error, not an empty graph).
    flamegraph::from_lines(&mut opts, lines, &mut out).ok()?;
    let svg = String::from_utf8(out).ok()?;
    Some(svg.replacen("<script", &format!("{EMBED_SHIM}<script"), 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::views::Weight;

    const WALL: Shown = Shown { by: By::Thread, weight: Weight::Wall };

    #[test]
    fn process_graphs_in_one_pass_match_one_at_a_time() {
        let a = profile("a", &[(1, &["main", "f"], None), (2, &["main", "g"], Some("g-1"))]);
        let b = profile("b", &[(1, &["main", "h"], None)]);
        let data = ProfileData::merge(&[&a, &b], Default::default());
        let one = |p: u32| svg_of(&data, &format!("p{p}"), WALL, &Only { process: Some(p), ..Only::default() });
        let both = process_svgs(&data, WALL, &[(1, "p1".into()), (0, "p0".into())]);
        assert_eq!(both, vec![one(1), one(0)]);
        assert!(both.iter().all(Option::is_some));
    }

    #[test]
    fn folds_and_renders() {
        let mut data =
            profile("w", &[(1, &["main", "f"], None), (1, &["main", "f"], None), (1, &["main", "g;x"], None)]);
        data.frames[0].name = "<script>alert(1)</script>".into();
        let lines = folded(&data, WALL, data.samples.iter(), true);
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().any(|l| l.ends_with("(f.py:1) 20000")));
        assert!(lines.iter().any(|l| l.ends_with(";g x (g x.py:1) 10000")), "{lines:?}");
        let svg = svg(&data, "t", WALL, data.samples.iter()).unwrap();
        assert!(svg.starts_with("<?xml"));
        assert!(!svg.contains("<script>alert(1)"), "names are escaped");
        assert!(svg.contains("&lt;script&gt;alert(1)"));
        assert!(super::svg(&data, "t", WALL, std::iter::empty()).is_none());
        data.frames[1].line = 7;
        let by_function = folded(&data, WALL, data.samples.iter(), false);
        assert!(by_function.iter().any(|l| l.ends_with(";f (f.py) 20000")), "{by_function:?}");
    }
}
