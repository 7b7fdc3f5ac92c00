//! What the demo shows: a line per second while a run goes, the worst 1 s window of each run,
//! and with `--out`, the arrivals as CSV and a chart of them as SVG.

use std::fmt::Write as _;
use std::time::Duration;

use super::vendor::Arrival;

/// The two runs the demo compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Run {
    /// Every instance on one budget.
    Shared,
    /// Each instance on a budget of its own: the control.
    Alone,
}

impl Run {
    pub(super) fn name(self) -> &'static str {
        match self {
            Run::Shared => "shared",
            Run::Alone => "alone",
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Run::Shared => "one shared budget",
            Run::Alone => "each instance pacing alone",
        }
    }
}

/// The most arrivals in any 1 s window (sliding: every window that starts at an arrival).
pub(super) fn worst_window(arrivals: &[Arrival]) -> usize {
    let mut at: Vec<Duration> = arrivals.iter().map(|a| a.at).collect();
    at.sort();
    let mut worst = 0;
    let mut end = 0;
    for (start, t) in at.iter().enumerate() {
        while end < at.len() && at[end] < *t + Duration::from_secs(1) {
            end += 1;
        }
        worst = worst.max(end - start);
    }
    worst
}

/// Arrivals in each whole second `[k, k + 1)`, for `seconds` seconds.
fn per_second(arrivals: &[Arrival], seconds: u64) -> Vec<usize> {
    let mut bins = vec![0; usize::try_from(seconds).unwrap_or_default()];
    for a in arrivals {
        if let Some(bin) = usize::try_from(a.at.as_secs())
            .ok()
            .and_then(|s| bins.get_mut(s))
        {
            *bin += 1;
        }
    }
    bins
}

/// The line printed when second `second` of a run has passed.
pub(super) fn live_line(
    run: Run,
    second: u64,
    arrivals: &[Arrival],
    instances: usize,
    ceiling: u32,
    backoff: f64,
) -> String {
    let in_second: Vec<&Arrival> = arrivals
        .iter()
        .filter(|a| a.at.as_secs() == second)
        .collect();
    let mut each = String::new();
    for i in 0..instances {
        let n = in_second.iter().filter(|a| a.instance == i).count();
        let _ = write!(each, "{n:3}");
    }
    let total = in_second.len();
    let throttles = arrivals.iter().filter(|a| a.status == 429).count();
    // One mark per arrival, the ceiling drawn as `|`; what is past it shows as `!`.
    let ceiling = usize::try_from(ceiling).unwrap_or(usize::MAX);
    let bar: String = (0..total.min(60))
        .map(|k| if k < ceiling { '#' } else { '!' })
        .collect();
    let (under, over) = bar.split_at(total.min(ceiling).min(bar.len()));
    format!(
        "{:<6} {:>8} {each}  = {total:3}  {under}{:pad$}|{over}  backoff {backoff:.2}  throttles {throttles}",
        run.name(),
        format!("{second}-{} s", second + 1),
        "",
        pad = ceiling.saturating_sub(under.len()),
    )
}

/// Every arrival of both runs, one line each.
pub(super) fn csv(runs: &[(Run, &[Arrival])]) -> String {
    let mut out = String::from("run,seconds,instance,status\n");
    for (run, arrivals) in runs {
        for a in *arrivals {
            let _ = writeln!(
                out,
                "{},{:.6},{},{}",
                run.name(),
                a.at.as_secs_f64(),
                a.instance + 1,
                a.status
            );
        }
    }
    out
}

/// Arrivals per second of both runs as an SVG chart, the ceiling as a line.
pub(super) fn svg(
    runs: &[(Run, &[Arrival])],
    seconds: u64,
    ceiling: u32,
) -> Result<String, String> {
    use plotters::prelude::*;
    let series: Vec<(Run, Vec<usize>)> = runs
        .iter()
        .map(|(run, arrivals)| (*run, per_second(arrivals, seconds)))
        .collect();
    let highest = series
        .iter()
        .flat_map(|(_, bins)| bins.iter().copied())
        .max()
        .unwrap_or(0)
        .max(usize::try_from(ceiling).unwrap_or(0));
    let top = (highest as f64 * 1.2).ceil().max(1.0);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 450)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| format!("cannot draw the chart: {e}");
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "pacegate demo: arrivals per second at the vendor",
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..seconds as f64, 0f64..top)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_labels(usize::try_from(seconds).unwrap_or(0).clamp(2, 30) + 1)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_desc("seconds into the run")
            .y_desc("arrivals per second")
            .draw()
            .map_err(|e| fail(&e))?;
        // The ceiling first, dashed under the runs: the shared run sits on it.
        let ceiling = f64::from(ceiling);
        // Wide and light, so that it still shows around the shared run's line.
        let grey = RGBColor(170, 170, 170);
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, ceiling), (seconds as f64, ceiling)],
                8,
                4,
                grey.stroke_width(6),
            ))
            .map_err(|e| fail(&e))?
            .label("the ceiling (rate)")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], grey));
        for (run, bins) in &series {
            let colour = match run {
                Run::Shared => BLUE,
                Run::Alone => RED,
            };
            // A step per second: flat over the second it counts.
            let steps = bins.iter().enumerate().flat_map(|(k, n)| {
                let (k, n) = (k as f64, *n as f64);
                [(k, n), (k + 1.0, n)]
            });
            chart
                .draw_series(LineSeries::new(steps, colour.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(run.legend())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: &[u64]) -> Vec<Arrival> {
        ms.iter()
            .map(|ms| Arrival {
                at: Duration::from_millis(*ms),
                instance: 0,
                status: 200,
            })
            .collect()
    }

    #[test]
    fn the_worst_window_slides_over_whole_seconds() {
        // Two per fixed second, but three within the second from 900 ms.
        assert_eq!(worst_window(&at(&[100, 900, 1100, 1800, 2500])), 3);
        // A window is half-open: an arrival exactly 1 s after another is in the next one.
        assert_eq!(worst_window(&at(&[0, 1000, 2000])), 1);
        assert_eq!(worst_window(&[]), 0);
    }

    #[test]
    fn per_second_counts_each_whole_second_and_drops_the_tail() {
        assert_eq!(per_second(&at(&[0, 999, 1000, 2500, 3100]), 3), [2, 1, 1]);
    }

    #[test]
    fn the_live_line_marks_what_is_past_the_ceiling() {
        let line = live_line(Run::Alone, 0, &at(&[0, 100, 200, 300]), 1, 2, 1.0);
        assert!(line.contains("##|!!"), "{line}");
        let line = live_line(Run::Shared, 0, &at(&[0]), 1, 3, 1.0);
        assert!(line.contains("#  |"), "{line}");
    }
}
