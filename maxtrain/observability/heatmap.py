"""Heatmaps of per-token log-probabilities on fixed eval samples: seeing what the model learns.

Every `viz_period` steps the trainer colours each token of the first `viz_num_samples` eval
sequences by log p(token | everything before it), from red (surprising, log p <= -10) through
yellow to green (predicted, log p = 0), and writes
    <run>/viz/step_<n>.html      hover a token for its log-probability; open in any browser
    TensorBoard image "viz/token_logprobs" (a PNG of the same heatmap: TensorBoard strips colours from HTML)
The samples are the first eval batch, so successive heatmaps show the same text as training goes on.
`python -m maxtrain.viz` draws one for a checkpoint.
"""

from __future__ import annotations

import functools
import html
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain import storage
from maxtrain.models.model import Model
from maxtrain.observability import png

LOGPROB_FLOOR = -10.0  # log p at or below this is fully red
_STOPS = np.asarray([[230, 80, 70], [255, 230, 150], [110, 195, 115]], np.float64)  # red, yellow, green
_UNSCORED = (221, 221, 221)  # grey: not predicted (a document's first token, padding)


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _rows_fn(model: Model, rt, mesh, num_rows: int):
    def rows(params, batch):
        logits, _ = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], rt)
        logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)
        out = {"inputs": batch["inputs"], "targets": batch["targets"], "weights": batch["loss_weights"],
               "logprobs": logprobs[..., 0]}
        return {k: v[:num_rows] for k, v in out.items()}

    # Replicated output: every process holds the rows, so process 0 can draw them in a multi-process run.
    return jax.jit(rows, out_shardings=NamedSharding(mesh, PartitionSpec()))


def token_logprobs(params, batch: dict, model: Model, rt, num_rows: int) -> dict:
    """For the first `num_rows` rows of a global eval batch: inputs, targets, weights and
    log p(targets[t] | inputs[:t + 1]), as host numpy arrays [num_rows, T]. Every process must call it."""
    mesh = batch["inputs"].sharding.mesh
    out = _rows_fn(model, rt, mesh, min(num_rows, batch["inputs"].shape[0]))(params, batch)
    return {k: np.asarray(v) for k, v in out.items()}


def color(logprob: float) -> tuple[int, int, int]:
    """Red at LOGPROB_FLOOR and below, yellow halfway, green at log p = 0."""
    t = min(max(1.0 - logprob / LOGPROB_FLOOR, 0.0), 1.0) * 2.0
    i = min(int(t), 1)
    rgb = _STOPS[i] + (t - i) * (_STOPS[i + 1] - _STOPS[i])
    return tuple(int(round(c)) for c in rgb)


# --------------------------------------------------------------------------------------------
# Tokens as text
# --------------------------------------------------------------------------------------------


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as it appears in the document (see Tokenizer.piece: a byte piece as its
    character, an id past the tokenizer's pieces as '<id N>')."""
    return tokenizer.piece(token_id)


def sample_tokens(rows: dict, tokenizer, i: int) -> list[tuple[str, float | None]]:
    """[(text, log p or None when not scored)] for sample i: its first input, then every target."""
    out = [(token_text(tokenizer, int(rows["inputs"][i, 0])), None)]
    for target, weight, logprob in zip(rows["targets"][i], rows["weights"][i], rows["logprobs"][i]):
        out.append((token_text(tokenizer, int(target)), float(logprob) if weight > 0 else None))
    return out


def summary(tokens) -> str:
    scored = [lp for _, lp in tokens if lp is not None]
    mean = float(np.mean(scored)) if scored else float("nan")
    return f"mean log p {mean:.3f} (loss {-mean:.3f}) over {len(scored)} predicted tokens"


# --------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------


def _hex(rgb) -> str:
    return "#%02x%02x%02x" % tuple(rgb)


def render_html(samples: list, title: str) -> str:
    """A self-contained HTML page: one block per sample, each token a coloured span with a tooltip."""
    legend = "".join(f'<span class="t lg" style="background:{_hex(color(v))}" title="log p = {v:g}">{v:g}</span>'
                     for v in np.linspace(LOGPROB_FLOOR, 0, 6))
    parts = [
        "<!doctype html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:70em}"
        "pre{font-family:monospace;font-size:14px;line-height:1.6;white-space:pre-wrap;word-break:break-all;"
        "border:1px solid #ccc;padding:.6em}"
        ".t{border-radius:2px}.lg{padding:0 .5em}.u{background:%s;color:#666}.nl{color:#888}</style></head><body>" % _hex(_UNSCORED),
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Each token is coloured by log p(token | everything before it): {legend} "
        f'(red: surprising, green: predicted; <span class="t u">grey</span>: not predicted, e.g. a document\'s '
        "first token). Hover a token for its value.</p>",
    ]
    for i, tokens in enumerate(samples):
        spans = []  # joined with nothing between them: inside <pre>, any whitespace would show
        for text, logprob in tokens:
            shown = html.escape(text).replace("\n", '<span class="nl">\u21b5</span>\n')
            if logprob is None:
                spans.append(f'<span class="t u" title="{html.escape(repr(text))}: not predicted">{shown}</span>')
            else:
                tip = f"{text!r}: log p = {logprob:.3f} (p = {np.exp(logprob):.3g})"
                spans.append(f'<span class="t" style="background:{_hex(color(logprob))}" '
                             f'title="{html.escape(tip)}">{shown}</span>')
        parts.append(f"<h2>sample {i}: {summary(tokens)}</h2><pre>{''.join(spans)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# PNG (for TensorBoard)
# --------------------------------------------------------------------------------------------


def render_png(samples: list, title: str, columns: int = 100, scale: int = 2) -> np.ndarray:
    """The same heatmap as an [H, W, 3] uint8 image: code laid out as text, `columns` characters wide."""
    lines: list[list[tuple[str, tuple]]] = []  # rows of (character, background)

    def text_line(text):
        lines.append([(c, None) for c in text[:columns]])

    text_line(title)
    text_line(f"colour = log p(token | everything before it): red <= {LOGPROB_FLOOR:g}, yellow, green = 0")
    lines.append([(f"{v:g}".ljust(6)[j], color(v)) for v in np.linspace(LOGPROB_FLOOR, 0, 6) for j in range(6)])
    for i, tokens in enumerate(samples):
        lines.append([])
        text_line(f"sample {i}: {summary(tokens)}")
        line: list = []
        for text, logprob in tokens:
            bg = _UNSCORED if logprob is None else color(logprob)
            for c in text.replace("\t", "    "):
                if c == "\n":
                    line.append((" ", bg))  # the newline's own colour, at the end of its line
                    lines.append(line)
                    line = []
                    continue
                if len(line) == columns:
                    lines.append(line)
                    line = []
                line.append((c, bg))
        lines.append(line)
    cw, ch, margin = png.CELL_W * scale, png.CELL_H * scale, 8
    canvas = np.full((2 * margin + ch * len(lines), 2 * margin + cw * columns, 3), 255, np.uint8)
    for row, line in enumerate(lines):
        for col, (c, bg) in enumerate(line):
            png.draw_text(canvas, margin + col * cw, margin + row * ch, c, bg=bg, scale=scale)
    return canvas


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_heatmap(step: int, params, batch: dict, model: Model, rt, tokenizer, writer=None) -> str | None:
    """Computes the heatmap of the first viz_num_samples rows of `batch` (a global eval batch) and, on
    process 0, writes <run>/viz/step_<step>.html and .png and the TensorBoard image. Every process
    must call it. Returns the HTML path (None on other processes)."""
    config = model.config
    rows = token_logprobs(params, batch, model, rt, config.viz_num_samples)
    if jax.process_index() != 0:
        return None
    samples = [sample_tokens(rows, tokenizer, i) for i in range(rows["targets"].shape[0])]
    title = f"maxtrain {config.run_name}: per-token log-probabilities at step {step}"
    directory = os.path.join(config.run_dir, "viz")  # local or gs://
    path = os.path.join(directory, f"step_{step}.html")
    storage.write_text(path, render_html(samples, title))
    image = png.encode_png(render_png(samples, title))
    storage.write_bytes(os.path.join(directory, f"step_{step}.png"), image)
    if writer is not None:
        writer.write_image("viz/token_logprobs", image, step)
    return path
