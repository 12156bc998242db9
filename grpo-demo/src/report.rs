//! Outputs of a run: metrics CSV, `reward.png`, and the end-of-run summary table.

use std::io::Write;
use std::path::Path;

use plotters::prelude::*;

use crate::train::StepMetrics;

/// CSV header, one row per GRPO step (`held_out_acc` empty where not evaluated).
pub const CSV_HEADER: &str =
    "step,elapsed_s,reward,groups_kept,groups_sampled,entropy,clip_frac,loss,held_out_acc";

/// The CSV text of `rows`.
pub fn csv(rows: &[StepMetrics]) -> String {
    let mut s = String::from(CSV_HEADER);
    s.push('\n');
    for m in rows {
        let acc = m
            .held_out_acc
            .map(|a| format!("{a:.4}"))
            .unwrap_or_default();
        s.push_str(&format!(
            "{},{:.2},{:.4},{},{},{:.4},{:.4},{:.6},{}\n",
            m.step,
            m.elapsed_s,
            m.reward,
            m.groups_kept,
            m.groups_sampled,
            m.entropy,
            m.clip_frac,
            m.loss,
            acc
        ));
    }
    s
}

/// Writes `text` to `path`.
pub fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::File::create(path)?.write_all(text.as_bytes())
}

/// Registers a system TrueType font for the plot's text, if one exists. plotters' `ab_glyph`
/// backend is pure Rust (no fontconfig); without a font file the plot is drawn without text.
fn register_font() -> bool {
    const CANDIDATES: [&str; 4] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ];
    for path in CANDIDATES {
        if let Ok(bytes) = std::fs::read(path) {
            // The registry wants 'static bytes; one font per process is a bounded leak.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

/// Draws train reward (every step) and held-out accuracy (evaluated steps) against the step.
pub fn plot(
    path: &Path,
    rows: &[StepMetrics],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let has_text = register_font();
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let last = rows.iter().map(|m| m.step).max().unwrap_or(1).max(1);
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16);
    if has_text {
        builder
            .caption(title, ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(50);
    }
    let mut chart = builder.build_cartesian_2d(0f64..last as f64, 0f64..1f64)?;
    let mut mesh = chart.configure_mesh();
    if has_text {
        mesh.x_desc("GRPO step")
            .y_desc("reward / accuracy")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.1}"));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    let reward: Vec<(f64, f64)> = rows
        .iter()
        .filter(|m| m.reward.is_finite())
        .map(|m| (m.step as f64, m.reward))
        .collect();
    let acc: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|m| m.held_out_acc.map(|a| (m.step as f64, a)))
        .collect();
    let blue = RGBColor(70, 110, 200);
    let red = RGBColor(210, 60, 40);
    let s = chart.draw_series(LineSeries::new(reward, blue.stroke_width(1)))?;
    if has_text {
        s.label("train reward (sampled, exact match)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue));
    }
    let s = chart.draw_series(LineSeries::new(acc.clone(), red.stroke_width(3)))?;
    if has_text {
        s.label("held-out accuracy (greedy)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red));
    }
    chart.draw_series(acc.iter().map(|&p| Circle::new(p, 3, red.filled())))?;
    if has_text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// The end-of-run summary.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Recipe name.
    pub loss: String,
    /// Held-out accuracy of the random initial policy.
    pub random_acc: f64,
    /// Held-out accuracy after the supervised warm-up.
    pub warmup_acc: f64,
    /// Held-out accuracy at the end.
    pub final_acc: f64,
    /// Best held-out accuracy seen at an evaluation.
    pub best_acc: f64,
    /// Mean train reward over the first 10 steps.
    pub reward_first: f64,
    /// Mean train reward over the last 10 steps.
    pub reward_last: f64,
    /// Warm-up steps taken.
    pub warmup_steps: usize,
    /// Warm-up seconds.
    pub warmup_s: f64,
    /// GRPO seconds.
    pub grpo_s: f64,
    /// GRPO steps.
    pub steps: usize,
    /// CPU seconds (user + system) of the whole process, if the OS reports them.
    pub cpu_s: Option<f64>,
}

impl Summary {
    /// A fixed-width table.
    pub fn table(&self) -> String {
        let pct = |v: f64| format!("{:5.1} %", 100.0 * v);
        let gain = self.final_acc - self.warmup_acc;
        let ratio = if self.warmup_acc > 0.0 {
            format!("{:.2}x", self.final_acc / self.warmup_acc)
        } else {
            "n/a".into()
        };
        let lines = [
            format!("recipe                      {}", self.loss),
            format!("held-out acc, random init   {}", pct(self.random_acc)),
            format!("held-out acc, after warm-up {}", pct(self.warmup_acc)),
            format!("held-out acc, final         {}", pct(self.final_acc)),
            format!("held-out acc, best eval     {}", pct(self.best_acc)),
            format!(
                "gain (final - warm-up)      {:+5.1} points, {ratio}",
                100.0 * gain
            ),
            format!("train reward, first 10 st.  {:.3}", self.reward_first),
            format!("train reward, last 10 st.   {:.3}", self.reward_last),
            format!(
                "warm-up / GRPO steps        {} / {}",
                self.warmup_steps, self.steps
            ),
            format!(
                "wall time: warm-up / GRPO   {:.1} s / {:.1} s",
                self.warmup_s, self.grpo_s
            ),
            format!(
                "CPU time (user + sys)       {}",
                self.cpu_s.map_or("n/a".into(), |c| format!("{c:.1} s"))
            ),
        ];
        let w = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0);
        let bar = format!("+{}+", "-".repeat(w + 2));
        let mut s = bar.clone();
        s.push('\n');
        for l in lines {
            s.push_str(&format!("| {l:<w$} |\n"));
        }
        s.push_str(&bar);
        s
    }
}

/// CPU seconds (user + system) this process has used, from `/proc/self/stat` (Linux); wall time
/// on a shared machine is an upper bound, CPU time is what the run itself costs.
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every mainstream Linux configuration.
    Some(ticks / 100.0)
}
