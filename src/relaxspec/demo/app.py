"""The demo's web page (gradio): choose a class (or write a prompt), a method and its knob, press *Race*, and watch
the same image decoded plainly and speculatively, token by token, with the numbers that explain
the speed-up. :func:`build_app` returns the page; :func:`race_handler` is its one event."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

import gradio as gr

from relaxspec import methods
from relaxspec.demo.race import KNOBS, DemoModel, RaceRequest, describe_lane, heat_map, resolve_request, run_lane, save_run
from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import write_png

LOG = logging.getLogger("relaxspec.demo")
#: Runs kept in the page's gallery (newest first).
GALLERY_SIZE = 8
#: System fonts only: the page asks nothing from the internet.
THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
INTRO = """# relaxspec: plain vs speculative decoding
The same image, the same seed, decoded twice on this machine: plainly (one target forward per
token) and with the method you choose (several tokens per forward). Grey cells are not decoded
yet. Times are measured live, while the page draws (`relaxspec bench` measures without drawing).
"""


class FrameFiles:
    """The images one race hands to the page, each written once, atomically, under a name of its
    own (``out/frames/<race>/NNNN.png``).

    gradio turns an array into a cache file named by its content and writes it with a plain,
    truncating write, so two races with an identical frame (the blank first frame of every lane,
    the AR lane of one class and seed) rewrote one file while a client was fetching it: "Too little
    data for declared Content-Length" (issue 20). Handed a path, gradio copies the file into its
    cache under a temporary name and renames it into place, and never rewrites a copy that exists.
    The copy is made before the update is sent, so a race's own files are removed when it ends:
    no client ever asks for them."""

    def __init__(self, out: Path) -> None:
        self.folder = out / "frames" / uuid.uuid4().hex
        self._numbers = itertools.count()

    def __call__(self, image) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{next(self._numbers):04d}.png"
        write_png(path, image)
        return str(path)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()  # when no other race is running
        except OSError:
            pass


def speculative_names() -> list[str]:
    return [name for name in methods.presets() if name not in ("ar", "ar-compiled")]


def read_request(model: DemoModel, condition, method, knob, seed, cfg_scale, encode: bool = True):
    """The page's inputs, as sent, -> ``(request, condition, options, sampling)``; a bad value
    raises :class:`RelaxspecError` (or ``ValueError`` / ``TypeError`` for a value of the wrong
    kind) with one line. ``encode=False``: a prompt is checked as text, not encoded."""
    knob = None if knob is None or not str(knob).strip() else str(knob).strip()
    try:
        knob = None if knob is None else float(knob)
    except ValueError:
        raise RelaxspecError(f"the knob must be a number (or empty for the preset's), got {shown(knob)}") from None
    request = RaceRequest(condition=condition or "", method=method or "", knob=knob,
                          seed=0 if seed in (None, "") else seed,
                          cfg_scale=None if cfg_scale in (None, "") else float(cfg_scale))
    return (request, *resolve_request(model, request, encode))


def check_handler(model: DemoModel, condition, method, knob, seed, cfg_scale) -> tuple[str, bool]:
    """The page's first answer to a press, before the race is queued (races run one at a time, so
    a bad input must not wait for the one in progress): ``(status line, whether to race)``. Only
    what is cheap is checked here; a prompt is encoded (and a too-long one refused) in the race."""
    try:
        read_request(model, condition, method, knob, seed, cfg_scale, encode=False)
    except (RelaxspecError, ValueError, TypeError) as err:
        return f"**Not run:** {err}", False
    return "queued: one race at a time on this page", True


def race_gate(ok: bool) -> None:
    """Stops the press's chain (without a message: the status line has it) when the check failed."""
    if not ok:
        raise gr.Error("not run", visible=False, print_exception=False)


def race_handler(model: DemoModel, out: Path, history: list, lock: threading.Lock, condition, method, knob, seed,
                 cfg_scale):
    """Validate the inputs (a bad one becomes the page's status line, never a traceback), then
    stream both lanes: ``(ar image, ar text, method image, method text, heat map, gallery, status)``."""
    blank = gr.update()
    try:
        request, resolved, options, sampling = read_request(model, condition, method, knob, seed, cfg_scale)
    except (RelaxspecError, ValueError, TypeError) as err:
        yield blank, blank, blank, blank, blank, blank, f"**Not run:** {err}"
        return
    seed = int(request.seed)
    status = f"racing `{options.describe()}` against AR, seed {seed}, cfg {sampling.cfg_scale:g}"
    frame = FrameFiles(out)
    try:
        ar = mine = None
        for ar in run_lane(model, resolved, methods.resolve("ar"), sampling, seed, request.upscale, "AR"):
            ar_frame = frame(ar.image)
            yield ar_frame, describe_lane(ar), None, "", None, blank, status
        for mine in run_lane(model, resolved, options, sampling, seed, request.upscale, request.method):
            yield ar_frame, describe_lane(ar), frame(mine.image), describe_lane(mine, ar), None, blank, status
        sizes = mine.result.token_step_sizes
        heat = heat_map(mine.result.accept_lengths[0], model.grid, cell=max(1, ar.image.shape[0] // model.grid),
                        per_token=None if sizes is None else sizes[0].numpy())
        with lock:
            path = save_run(out, ar, mine)
            caption = f"{condition} · {request.method} · seed {seed}: {ar.seconds / mine.seconds:.2f}x"
            history.insert(0, (str(path), caption))
            del history[GALLERY_SIZE:]
            gallery = list(history)
        yield (ar_frame, describe_lane(ar), frame(mine.image), describe_lane(mine, ar), frame(heat), gallery,
               f"done: {request.method} {ar.seconds / mine.seconds:.2f}x AR")
    except RelaxspecError as err:
        yield blank, blank, blank, blank, blank, blank, f"**Not run:** {err}"
    except Exception as err:  # a bug: said in the page in one line, the traceback goes to the console
        LOG.exception("relaxspec demo: the race failed")
        yield blank, blank, blank, blank, blank, blank, f"**Failed:** {type(err).__name__}: {err} (see the console)"
    finally:
        # gradio copied each frame into its cache before sending it; a cancelled race stops here too.
        frame.remove()


def build_app(model: DemoModel, out: str | Path) -> gr.Blocks:
    """The page, decoding with ``model`` and keeping its runs' images in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # gradio keeps every image it serves in its temporary folder: inside ``out``, and pruned.
    os.environ.setdefault("GRADIO_TEMP_DIR", str((out / "gradio-tmp").resolve()))
    history: list = []
    lock = threading.Lock()
    names = model.class_names
    default_class = model.default_class or (names[0] if names else "0")
    with gr.Blocks(title="relaxspec demo", delete_cache=(600, 1800)) as app:
        gr.Markdown(INTRO)
        with gr.Row():
            # Dropdowns take any value (allow_custom_value): a name outside the list is refused by the
            # check below in one line, not by gradio's choice check with a traceback in the console.
            if model.prompts:
                condition = gr.Textbox(value=model.default_class or "", label="prompt", elem_id="condition")
            elif names:
                condition = gr.Dropdown(names, value=default_class, label="class", elem_id="condition",
                                        allow_custom_value=True)
            else:
                condition = gr.Textbox(value=default_class, label="class id", elem_id="condition")
            method = gr.Dropdown(speculative_names(), value=model.default_method, label="method", elem_id="method",
                                 allow_custom_value=True)
            knob = gr.Textbox(value="", label="knob: " + ", ".join(f"{m} {k}" for m, k in KNOBS.items()),
                              placeholder="empty: the preset's value", elem_id="knob")
            seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
            cfg = gr.Number(value=model.sampling.get("cfg_scale", 4.0), label="cfg scale", elem_id="cfg")
        run = gr.Button("Race", variant="primary", elem_id="race")
        status = gr.Markdown("", elem_id="status")
        with gr.Row():
            with gr.Column():
                # Images are handed over as files written once (FrameFiles), never as arrays.
                ar_image = gr.Image(label="AR", format="png", type="filepath", interactive=False, elem_id="ar-image")
                ar_text = gr.Markdown(elem_id="ar-text")
            with gr.Column():
                my_image = gr.Image(label="speculative", format="png", type="filepath", interactive=False,
                                    elem_id="method-image")
                my_text = gr.Markdown(elem_id="method-text")
            with gr.Column():
                heat = gr.Image(label="tokens committed per step (blue 1 ... yellow most)", format="png", type="filepath",
                                interactive=False, elem_id="heat")
        gallery = gr.Gallery(label="last runs (AR | method)", columns=4, height=220, object_fit="contain",
                             elem_id="gallery")

        ok = gr.State(False)

        def check(condition, method, knob, seed, cfg):
            return check_handler(model, condition, method, knob, seed, cfg)

        def handler(condition, method, knob, seed, cfg):
            yield from race_handler(model, out, history, lock, condition, method, knob, seed, cfg)

        inputs = [condition, method, knob, seed, cfg]
        # A press: the inputs are checked at once, outside the queue (a bad one is the status line
        # in a blink, even while another race runs); only a good one is queued to race. The race
        # itself checks again: it is also the API endpoint /race.
        (run.click(check, inputs, [status, ok], queue=False, api_visibility="private")
            .then(race_gate, ok, None, queue=False, api_visibility="private")
            .success(handler, inputs, [ar_image, ar_text, my_image, my_text, heat, gallery, status], api_name="race",
                     concurrency_limit=1))
    return app


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, block: bool = True,
           quiet: bool = True, out: str | Path | None = None):
    """Serve ``app`` on ``host:port`` (loopback by default) without server-side rendering; returns
    the URL. ``block=False`` returns at once (the caller closes the app with ``app.close()``).
    ``out``: the folder :func:`build_app` keeps its runs in, which the page may serve files from
    wherever it is (gradio otherwise serves only the working and temporary folders)."""
    allowed = [str(Path(out).resolve())] if out is not None else []
    _, url, _ = app.queue().launch(server_name=host, server_port=port, prevent_thread_lock=not block, ssr_mode=False,
                                   theme=THEME, quiet=quiet, footer_links=[], show_error=False,
                                   allowed_paths=allowed)
    return url


__all__ = ["build_app", "check_handler", "launch", "race_handler", "read_request", "speculative_names"]
