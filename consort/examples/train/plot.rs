//! The loss and accuracy curves as a PNG (plotters, with an embedded
//! DejaVu Sans so that it renders the same on a machine with no fonts).

use std::path::Path;

use plotters::prelude::*;

use crate::canvas::{Area, on_axis, save_png, top};

const FONT: &[u8] = include_bytes!("assets/DejaVuSans.ttf");

/// One epoch's figures.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Epoch {
    pub(crate) epoch: usize,
    pub(crate) train_loss: f64,
    pub(crate) test_accuracy: f64,
}

/// Draws training loss (left) and test accuracy (right) against epochs,
/// into a new file renamed over `path` (never through a link planted
/// there). Any figures draw, in finite time: the axes are finite and
/// the points held to them.
pub(crate) fn draw(path: &Path, history: &[Epoch], title: &str) -> Result<(), String> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the embedded font does not load".to_string())?;
    save_png(path, (1100, 450), |root| charts(root, history, title))
}

fn charts(root: &Area<'_>, history: &[Epoch], title: &str) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    // Epochs are counts; the axis ends past the first one whatever the
    // history says.
    let last = history.last().map_or(1, |e| e.epoch).clamp(2, 1 << 40);
    let max_loss = top(history
        .iter()
        .map(|e| e.train_loss)
        .filter(|l| l.is_finite())
        .fold(0.0, f64::max));
    let loss = history.iter().map(|e| (e.epoch, e.train_loss));
    chart(
        &left,
        ("training loss", "cross-entropy"),
        (last, 0.0, max_loss),
        on_axis(loss, (0.0, max_loss)),
        RED,
    )?;
    let lo = history
        .iter()
        .map(|e| e.test_accuracy)
        .filter(|a| a.is_finite())
        .fold(100.0, f64::min)
        .clamp(0.0, 90.0)
        .floor();
    let acc = history.iter().map(|e| (e.epoch, e.test_accuracy));
    chart(
        &right,
        ("test accuracy", "accuracy (%)"),
        (last, lo, 100.0),
        on_axis(acc, (lo, 100.0)),
        BLUE,
    )
}

/// One curve against epochs `1..last`, its value axis `lo..hi`.
fn chart(
    area: &Area<'_>,
    (caption, y_desc): (&str, &str),
    (last, lo, hi): (usize, f64, f64),
    points: impl Iterator<Item = (usize, f64)>,
    color: RGBColor,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(1usize..last, lo..hi)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("epoch")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(
        points.map(|(x, y)| (x.clamp(1, last), y)),
        color.stroke_width(2),
    ))
    .map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Draws `history` on a thread; fails if it has not finished within a
    /// (generous) deadline: the bug this guards against never finished.
    fn draws_in_time(name: &str, history: Vec<Epoch>) {
        let dir = std::env::temp_dir().join(format!("consort-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("training.png");
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || tx.send(draw(&p, &history, "extremes")));
        let done = rx.recv_timeout(Duration::from_secs(120));
        let drawn = done.unwrap_or_else(|_| panic!("{name}: drawing did not finish"));
        drawn.unwrap_or_else(|e| panic!("{name}: {e}"));
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[1..4], b"PNG", "{name}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn epochs(figures: &[(usize, f64, f64)]) -> Vec<Epoch> {
        figures
            .iter()
            .map(|&(epoch, train_loss, test_accuracy)| Epoch {
                epoch,
                train_loss,
                test_accuracy,
            })
            .collect()
    }

    #[test]
    fn any_figures_draw_in_finite_time() {
        let cases = [
            ("huge", epochs(&[(1, 1.7e308, 50.0), (2, 0.5, 60.0)])),
            (
                "max",
                epochs(&[(1, f64::MAX, f64::MAX), (2, -f64::MAX, -f64::MAX)]),
            ),
            (
                "tiny",
                epochs(&[(1, f64::MIN_POSITIVE, 1e-300), (2, 0.0, 0.0)]),
            ),
            (
                "nonfinite",
                epochs(&[(1, f64::NAN, f64::INFINITY), (3, f64::INFINITY, f64::NAN)]),
            ),
            ("flat", epochs(&[(1, 0.0, 100.0), (2, 0.0, 100.0)])),
            ("one", epochs(&[(1, 2.3, 10.0)])),
            ("none", Vec::new()),
            ("far", epochs(&[(0, 1.0, 50.0), (usize::MAX, 1.0, 50.0)])),
        ];
        for (name, history) in cases {
            draws_in_time(name, history);
        }
    }
}
