//! The loss and accuracy curves as a PNG (plotters, with an embedded
//! DejaVu Sans so that it renders the same on a machine with no fonts).

use std::path::Path;

use plotters::prelude::*;

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
/// there).
pub(crate) fn draw(path: &Path, history: &[Epoch], title: &str) -> Result<(), String> {
    consort_comm::files::with_replacing(path, |tmp| {
        draw_to(tmp, history, title).map_err(std::io::Error::other)
    })
    .map_err(|e| format!("drawing {}: {e}", path.display()))
}

/// The top of an axis for values up to `max`: finite and above zero
/// whatever the figures (plotters never ends on an infinite range).
fn top(max: f64) -> f64 {
    if max.is_finite() {
        (max.clamp(1e-3, 1e12)) * 1.1
    } else {
        1.0
    }
}

fn draw_to(path: &Path, history: &[Epoch], title: &str) -> Result<(), String> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the embedded font does not load".to_string())?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    let last = history.last().map_or(1, |e| e.epoch).max(1);
    let max_loss = top(history
        .iter()
        .map(|e| e.train_loss)
        .filter(|l| l.is_finite())
        .fold(0.0, f64::max));

    let mut c = ChartBuilder::on(&left)
        .caption("training loss", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(1usize..last, 0f64..max_loss)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("epoch")
        .y_desc("cross-entropy")
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(
        history.iter().map(|e| (e.epoch, e.train_loss)),
        RED.stroke_width(2),
    ))
    .map_err(|e| err(&e))?;

    let lo = history
        .iter()
        .map(|e| e.test_accuracy)
        .filter(|a| a.is_finite())
        .fold(100.0, f64::min)
        .clamp(0.0, 90.0)
        .floor();
    let mut c = ChartBuilder::on(&right)
        .caption("test accuracy", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(1usize..last, lo..100f64)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("epoch")
        .y_desc("accuracy (%)")
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(
        history.iter().map(|e| (e.epoch, e.test_accuracy)),
        BLUE.stroke_width(2),
    ))
    .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
