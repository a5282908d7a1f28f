//! Plots drawn in memory and saved as PNG in one piece through
//! `consort_comm::files::write_replacing`: nothing opens the output by
//! name but that helper (plotters' `BitMapBackend::new(path)` would,
//! following a link planted there), and a reader never sees half an image.
//! Shared by the trainer and the GPT example.

use std::path::Path;

use plotters::{coord::Shift, prelude::*};

/// A drawing area on an in-memory RGB canvas.
pub(crate) type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Runs `draw` on a `w`×`h` canvas, then writes it to `path` as a PNG.
pub(crate) fn save_png(
    path: &Path,
    (w, h): (u32, u32),
    draw: impl FnOnce(&Area<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        draw(&root).map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    let mut bytes = Vec::new();
    let mut enc = png::Encoder::new(&mut bytes, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()
        .and_then(|mut out| out.write_image_data(&rgb))
        .map_err(|e| err(&e))?;
    consort_comm::files::write_replacing(path, &bytes)
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The top of a value axis that starts at 0, for values whose largest is
/// `max`: finite, above zero and with room above the curve, whatever the
/// figures (an infinite or NaN range made plotters loop for ever).
pub(crate) fn top(max: f64) -> f64 {
    if max.is_finite() {
        max.clamp(1e-3, 1e12) * 1.1
    } else {
        1.0
    }
}

/// The points of a curve that fit a chart whose value axis is `lo..hi`:
/// values that are not finite are left out, the others held to the axis
/// (a point far off the canvas is a line plotters would walk pixel by
/// pixel).
pub(crate) fn on_axis<X>(
    points: impl IntoIterator<Item = (X, f64)>,
    (lo, hi): (f64, f64),
) -> impl Iterator<Item = (X, f64)> {
    points
        .into_iter()
        .filter(|p| p.1.is_finite())
        .map(move |(x, y)| (x, y.clamp(lo, hi)))
}
