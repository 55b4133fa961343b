"""relaxspec demo: the race's functions directly, the served page through gradio's own client,
and the page in a real headless Chromium (Debian's, which .ci/run installs)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

import relaxspec
from relaxspec import methods
from relaxspec.demo.race import (PENDING, DemoModel, RaceRequest, describe_lane, heat_map, partial_image,
                                 resolve_request, run_lane)
from relaxspec.errors import RelaxspecError

gradio = pytest.importorskip("gradio", reason="the demo's tests need gradio (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def model() -> DemoModel:
    from relaxspec.pipelines import open_pipeline

    return DemoModel(open_pipeline(), "lantern", "heart")


@pytest.mark.parametrize("request_, message", [
    (RaceRequest("no-such-class", "lantern"), "unknown class 'no-such-class'"),
    (RaceRequest("heart,time", "lantern"), "choose one class"),
    (RaceRequest("", "lantern"), "choose a class"),
    (RaceRequest("heart", "magic"), "unknown method 'magic'"),
    (RaceRequest("heart", "ar"), "choose a speculative method"),
    (RaceRequest("heart", "lantern", knob=2.0), "--delta is an additive TV budget in [0, 1], got 2.0"),
    (RaceRequest("heart", "lantern++", knob=0.5), "--lam is a multiplicative bound >= 1"),
    (RaceRequest("heart", "sd", knob=0.3), "--method sd has no knob"),
    (RaceRequest("heart", "lantern", seed=-1), "seed must be a whole number in [0, 2^40)"),
    (RaceRequest("heart", "lantern", seed=10 ** 15), "seed must be a whole number in [0, 2^40)"),
    (RaceRequest("heart", "lantern", cfg_scale=-1.0), "cfg scale"),
])
def test_bad_requests_are_one_line_messages(model, request_, message):
    with pytest.raises(RelaxspecError) as err:
        resolve_request(model, request_)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_request_means_what_generate_means(model):
    condition, options, sampling = resolve_request(model, RaceRequest("heart", "lantern", knob=0.2, seed=3, cfg_scale=2.0))
    assert condition.cond.tolist() == [model.class_names.index("heart")] and condition.mask is None
    assert options.to_dict() == methods.resolve("lantern", {"delta": 0.2}, model.presets).to_dict()
    assert sampling.cfg_scale == 2.0 and sampling.top_k == model.sampling["top_k"]


def test_partial_images_grey_out_pending_tokens(model):
    tokens = relaxspec.generate("heart", "ar", seed=0).result.tokens[0]
    cell = model.vq.config.downsample_factor
    empty = partial_image(model, tokens, 0)
    assert (empty == PENDING).all()
    half = partial_image(model, tokens, 20, upscale=2)
    grid = model.grid
    assert half.shape == (grid * cell * 2, grid * cell * 2, 3)
    row, col = divmod(20, grid)  # token 20 is the first pending one
    assert (half[row * cell * 2, col * cell * 2] == PENDING).all()
    full = partial_image(model, tokens, tokens.shape[0])
    assert not (full == PENDING).all(axis=-1).all()
    second_row = torch.zeros(tokens.shape[0], dtype=torch.bool)
    second_row[grid : 2 * grid] = True  # rows in parallel: a mask of the committed tokens
    shown = partial_image(model, tokens, second_row)
    assert (shown[:cell] == PENDING).all() and (shown[2 * cell :] == PENDING).all()
    assert not (shown[cell : 2 * cell] == PENDING).all(axis=-1).all()


def test_heat_map_colours_each_token_by_its_step():
    image = heat_map([1, 3, 2, 1, 1, 1], grid=3, cell=2)
    assert image.shape == (6, 6, 3)
    cells = image[::2, ::2].reshape(9, 3)
    assert (cells[1] == cells[2]).all() and (cells[1] == cells[3]).all()  # the three tokens of one step
    assert (cells[0] == cells[6]).all() and not (cells[0] == cells[1]).all()


def test_rows_in_parallel_show_their_commits_out_of_raster_order(model, monkeypatch):
    """ZipAR paints several rows at once: a frame shows the committed tokens wherever they are
    (a later row's tokens before an earlier row is complete), the lane ends with generate's
    tokens, and the heat map colours each token by its own step's commits."""
    from relaxspec.demo import race

    monkeypatch.setattr(race, "FRAME_SECONDS", 0.0)  # every step a frame
    condition, options, sampling = resolve_request(model, RaceRequest("heart", "zipar", seed=5))
    grid, cell = model.grid, model.vq.config.downsample_factor
    out_of_order = False
    final = None
    for lane in run_lane(model, condition, options, sampling, 5, 1, "ZipAR"):
        pending = (lane.image[::cell, ::cell] == PENDING).all(axis=-1).reshape(-1)  # per token, raster order
        assert int((~pending).sum()) == lane.done
        first_pending = int(pending.nonzero()[0][0]) if pending.any() else grid * grid
        out_of_order |= bool((~pending[first_pending:]).any())
        final = lane
    assert out_of_order and final.done == grid * grid
    assert torch.equal(final.result.tokens, relaxspec.generate("heart", "zipar", seed=5).result.tokens)
    sizes = final.result.token_step_sizes[0]
    assert sizes.shape == (grid * grid,) and sizes[0] == 1 and sizes.max() > 1
    lengths = final.result.accept_lengths[0]
    for k in set(lengths):  # a step that commits k tokens gives k tokens the count k
        assert int((sizes == k).sum()) == k * lengths.count(k), k
    heat = heat_map(final.result.accept_lengths[0], grid, cell=1, per_token=sizes.numpy())
    colours = heat.reshape(-1, 3)
    for a in range(grid * grid):
        for b in range(grid * grid):
            if sizes[a] == sizes[b]:
                assert (colours[a] == colours[b]).all()


@pytest.mark.slow
def test_a_lane_streams_and_ends_with_generate_tokens(model, monkeypatch):
    from relaxspec.demo import race

    monkeypatch.setattr(race, "FRAME_SECONDS", 0.0)  # every step a frame
    condition, options, sampling = resolve_request(model, RaceRequest("heart", "lantern", seed=5))
    lanes = [(lane.done, lane.image.copy()) for lane in run_lane(model, condition, options, sampling, 5, 4, "LANTERN")]
    done = [d for d, _ in lanes]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 64 and len(done) > 5
    final = lane = None
    for lane in run_lane(model, condition, options, sampling, 5, 4, "LANTERN"):
        final = lane
    expected = relaxspec.generate("heart", "lantern", seed=5)
    assert torch.equal(final.result.tokens, expected.result.tokens)
    assert "speed-up vs AR" in describe_lane(final, final) and "sum of one-step TVs" in describe_lane(final)


@pytest.mark.slow
def test_an_abandoned_lane_stops_its_decode(model):
    """A cancelled request (the page closed mid-race) stops the decode thread at its next step, so
    no decode keeps running on the model's cache under the next race."""
    import threading

    condition, options, sampling = resolve_request(model, RaceRequest("heart", "sjd"))
    lane = run_lane(model, condition, options, sampling, 0, 1, "SJD")
    next(lane), next(lane)
    before = threading.active_count()
    lane.close()
    assert threading.active_count() == before - 1
    final = None
    for final in run_lane(model, condition, options, sampling, 0, 1, "SJD"):
        pass
    assert torch.equal(final.result.tokens, relaxspec.generate("heart", "sjd", seed=0).result.tokens)


def read_race(race) -> list[tuple]:
    """A race's updates with each image file read as the page fetches it, while the race runs
    (gradio copies a frame before sending it; the race removes its own files when it ends)."""
    from PIL import Image

    def read(value):
        return np.asarray(Image.open(value)) if isinstance(value, str) and value.endswith(".png") else value

    return [tuple(read(value) if i in (0, 2, 4) else value for i, value in enumerate(update)) for update in race]


@pytest.mark.slow
def test_race_handler_streams_both_sides_and_keeps_the_run(model, tmp_path):
    import threading

    from relaxspec.demo.app import race_handler

    history: list = []
    from PIL import Image

    opened: list = []

    def frames(race):  # each update's images open as the page would fetch them (gradio copies them then)
        for update in race:
            opened.extend(np.asarray(Image.open(update[i])) for i in (0, 2, 4) if isinstance(update[i], str))
            yield update

    updates = list(frames(race_handler(model, tmp_path, history, threading.Lock(), "heart", "cool", None, 1, None)))
    ar_image, ar_text, my_image, my_text, heat, gallery, status = updates[-1]
    assert all(isinstance(update[0], str) for update in updates)  # files, never arrays gradio would rewrite
    assert opened[-3].shape == opened[-2].shape and heat is not None and not Path(heat).exists()  # race files removed
    assert "speed-up vs AR" in my_text and "target forwards: 64" in ar_text and status.startswith("done: cool")
    assert len(updates) > 3 and gallery == history and Path(history[0][0]).parent == tmp_path
    assert sorted(os.listdir(tmp_path)) == ["0000.png"]
    again = list(race_handler(model, tmp_path, history, threading.Lock(), "heart", "sjd", None, 2, None))
    assert again[-1][-1].startswith("done: sjd") and sorted(os.listdir(tmp_path)) == ["0000.png", "0001.png"]
    bad = list(race_handler(model, tmp_path, history, threading.Lock(), "heart", "lantern", "7", 1, None))
    assert len(bad) == 1 and bad[0][-1].startswith("**Not run:** --delta is an additive TV budget")
    word = list(race_handler(model, tmp_path, history, threading.Lock(), "heart", "lantern", "much", 1, None))
    assert word[0][-1] == "**Not run:** the knob must be a number (or empty for the preset's), got 'much'"


def page_inputs(app) -> dict:
    """The page's components by elem_id."""
    return {block.elem_id: block for block in app.blocks.values() if getattr(block, "elem_id", None)}


def test_a_class_model_gets_the_class_picker_and_a_prompt_model_the_prompt_box(model, tmp_path):
    """Issue 33: ``model.prompts is not None`` held for a class model too (a bool is never None),
    so the embedded model's page showed a prompt box and answered a prompt with "unknown class"."""
    from relaxspec.demo.app import build_app
    from helpers.emu3 import emu3_folder_at
    from relaxspec.cli import build_parser
    from relaxspec.cli.demo import load_demo_model

    condition = page_inputs(build_app(model, tmp_path / "a"))["condition"]
    assert isinstance(condition, gradio.Dropdown) and condition.label == "class"
    assert [choice[0] for choice in condition.choices] == model.class_names and condition.value == "heart"
    args = build_parser().parse_args(["demo", "--model-path", str(emu3_folder_at(tmp_path / "emu3")), "--image-size",
                                      "32", "--prompt", "a red fox"])
    prompted = page_inputs(build_app(load_demo_model(args), tmp_path / "b"))["condition"]
    assert isinstance(prompted, gradio.Textbox) and prompted.label == "prompt" and prompted.value == "a red fox"


def test_a_press_is_checked_outside_the_queue_and_only_a_good_one_races(model, tmp_path):
    """Races queue one at a time; a bad input must not wait behind the race in progress for its
    one-line answer. The press runs the check unqueued, and the queued race follows only a check
    that passed."""
    from relaxspec.demo.app import build_app, check_handler

    app = build_app(model, tmp_path)
    race = page_inputs(app)["race"]
    chain = [fn for fn in app.fns.values() if any(target[0] == race._id for target in fn.targets)]
    assert len(chain) == 1 and chain[0].queue is False  # the check, on the click itself
    after = {fn.trigger_after: fn for fn in app.fns.values() if fn.trigger_after is not None}
    gate = after[chain[0]._id]
    racing = after[gate._id]
    assert gate.queue is False and racing.trigger_only_on_success and racing.api_name == "race"
    assert racing.concurrency_limit == 1
    assert check_handler(model, "heart", "lantern", "9", 0, None) == (
        "**Not run:** --delta is an additive TV budget in [0, 1], got 9.0", False)
    assert check_handler(model, "heart", "magic", "", 0, None)[1] is False
    assert check_handler(model, "heart", "lantern", "", 0, 4.0) == ("queued: one race at a time on this page", True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(model, tmp_path, monkeypatch):
    """The page on a free loopback port; always closed."""
    from relaxspec.demo.app import build_app, launch

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio-tmp"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    app = build_app(model, tmp_path / "out")
    url = launch(app, "127.0.0.1", free_port(), block=False, out=tmp_path / "out")
    try:
        yield url, tmp_path
    finally:
        app.close()


@pytest.mark.slow
def test_the_served_page_races_through_gradios_client(served):
    from gradio_client import Client

    url, folder = served
    assert url.startswith("http://127.0.0.1:")
    client = Client(url, verbose=False)
    ar_image, ar_text, my_image, my_text, heat, gallery, status = client.predict(
        "heart", "lantern", "", 0, 4.0, api_name="/race")
    assert Path(ar_image).is_file() and Path(my_image).is_file() and Path(heat).is_file()
    assert "speed-up vs AR" in my_text and status.startswith("done: lantern")
    assert (folder / "out" / "0000.png").is_file()
    *_, bad = client.predict("heart", "lantern", "3", 0, 4.0, api_name="/race")
    assert bad.startswith("**Not run:**") and "additive TV budget" in bad


@pytest.mark.slow
def test_values_outside_the_lists_are_one_line_not_a_server_traceback(served, capfd):
    """Issue 33: a method (or class) outside the dropdown's list failed gradio's choice check with a
    traceback in the server's console; the page's check answers it in the status line."""
    from gradio_client import Client

    url, _ = served
    client = Client(url, verbose=False)
    *_, method = client.predict("heart", "magic", "", 0, 4.0, api_name="/race")
    *_, condition = client.predict("no-such-class", "lantern", "", 0, 4.0, api_name="/race")
    assert method.startswith("**Not run:** unknown method 'magic'")
    assert condition.startswith("**Not run:** unknown class 'no-such-class'")
    logged = capfd.readouterr()
    assert "Traceback" not in logged.err + logged.out and "Error" not in logged.err


@pytest.mark.slow
def test_several_races_at_once_serve_every_file_whole(served, capfd, caplog, monkeypatch):
    """Issue 20: six races submitted at once all answered, but the server logged
    ``h11 LocalProtocolError: Too little data for declared Content-Length``: a file was served
    while gradio rewrote it in place. gradio writes an image handed to it as an array to a cache
    file named by its content, with a plain (truncating) write, so identical frames -- the blank
    first frame of every lane, the AR lanes of one class and seed -- rewrite one file while other
    clients fetch it. Every race must answer, every image it returns (final and streamed) must
    open, no cache file may be written twice, and the server must log no error."""
    import logging

    from gradio import processing_utils
    from gradio_client import Client
    from PIL import Image

    written: list[str] = []
    real_save = processing_utils.save_pil_to_cache

    def recording_save(*args, **kwargs):
        written.append(real_save(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(processing_utils, "save_pil_to_cache", recording_save)
    caplog.set_level(logging.WARNING)
    url, folder = served
    client = Client(url, verbose=False)
    requests = [("heart", "lantern", ""), ("time", "sd", ""), ("heart", "cool", ""), ("heart", "gsd", ""),
                ("heart", "lantern", "7"), ("heart", "lantern++", "0.5")]
    jobs = [client.submit(condition, method, knob, 0, 4.0, api_name="/race") for condition, method, knob in requests]
    answers = [job.result(timeout=600) for job in jobs]
    for (condition, method, knob), job, answer in zip(requests, jobs, answers):
        status = answer[-1]
        if knob:
            assert status.startswith("**Not run:**"), status
            continue
        assert status.startswith(f"done: {method}"), status
        streamed = [update[i] for update in job.outputs() for i in (0, 2, 4) if isinstance(update[i], str)]
        for path in [answer[0], answer[2], answer[4], *streamed]:
            with Image.open(path) as image:
                image.load()  # a truncated file fails here
    rewritten = sorted({path for path in written if written.count(path) > 1})
    assert not rewritten, f"{len(rewritten)} cache files were written more than once (in place)"
    logged = capfd.readouterr()
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not problems, problems
    assert "Traceback" not in logged.err + logged.out and "LocalProtocolError" not in logged.err + logged.out


CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                    reason="no headless browser: install Debian's chromium and chromium-driver (.ci/run does)")
def test_a_real_browser_presses_race_and_sees_both_images(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    url, folder = served
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1100", f"--user-data-dir={folder / 'chromium-profile'}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        browser.get(url)
        wait = WebDriverWait(browser, 120)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#race"))
        # Issue 33: a class model's page is a class picker, not a prompt box.
        picker = browser.find_elements(By.CSS_SELECTOR, "#condition input[role='combobox']")
        assert picker and picker[0].get_attribute("aria-label") == "class", \
            browser.find_element(By.CSS_SELECTOR, "#condition").text
        assert not browser.find_elements(By.CSS_SELECTOR, "#condition textarea")
        assert picker[0].get_attribute("value") == "heart"
        picker[0].click()
        picker[0].send_keys(Keys.CONTROL, "a")
        picker[0].send_keys("time")
        wait.until(lambda b: [o.text for o in b.find_elements(By.CSS_SELECTOR, "ul[role='listbox'] li")] == ["time"])
        picker[0].send_keys(Keys.ENTER)
        browser.find_element(By.CSS_SELECTOR, "#race").click()
        wait.until(lambda b: "done:" in b.find_element(By.CSS_SELECTOR, "#status").text)
        assert (folder / "out" / "0000.png").is_file()
        assert "time · lantern" in browser.find_element(By.CSS_SELECTOR, "#gallery").get_attribute("innerHTML")
        text = browser.find_element(By.CSS_SELECTOR, "#method-text").text  # the preset, relaxed: a sum over 1
        assert "sum of one-step TVs" in text and "no bound on this image's TV" in text and "certificate" not in text
        for side in ("#ar-image", "#method-image", "#heat"):
            images = browser.find_elements(By.CSS_SELECTOR, f"{side} img")
            assert images and images[0].get_attribute("src"), side
            assert browser.execute_script("return arguments[0].naturalWidth", images[0]) > 0, side
        assert "speed-up vs AR" in browser.find_element(By.CSS_SELECTOR, "#method-text").text
        shot = Path(os.environ.get("RELAXSPEC_DEMO_SCREENSHOT", folder / "demo.png"))
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        # A bad value typed into the page: a message in the page, no traceback, nothing decoded.
        knob = browser.find_element(By.CSS_SELECTOR, "#knob textarea, #knob input")
        knob.send_keys("9")
        browser.find_element(By.CSS_SELECTOR, "#race").click()
        wait.until(lambda b: "Not run" in b.find_element(By.CSS_SELECTOR, "#status").text)
        status = browser.find_element(By.CSS_SELECTOR, "#status").text
        assert "--delta is an additive TV budget in [0, 1], got 9.0" in status and "Traceback" not in browser.page_source
    finally:
        browser.quit()


@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port must be 1..65535"),
    (["--out", "FILE"], "exists and is not a folder"),
    (["--vq-ckpt", "vq.pt"], "--vq-ckpt goes with --gpt-ckpt (LlamaGen); this model is the embedded model"),
    (["--prompt", "a fox"], "--prompt goes with a text-to-image model; the embedded model is class-conditional"),
    (["--negative-prompt", "dark"], "--negative-prompt goes with --model-path"),
])
def test_demo_command_errors(tmp_path, capsys, argv, message):
    from relaxspec.cli import main

    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_command_serves_the_page_on_loopback(tmp_path):
    """``relaxspec demo`` as a user starts it: the page answers on 127.0.0.1, and the process is
    always stopped."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "relaxspec.cli", "demo", "--port", str(port), "--out",
                                str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, page = time.monotonic() + 120, None
        while time.monotonic() < deadline and page is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            except OSError:
                assert process.poll() is None, process.stdout.read()
                time.sleep(0.5)
        assert page is not None and "relaxspec demo" in page
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert f"relaxspec demo: http://127.0.0.1:{port}" in output
    assert (tmp_path / "out").is_dir() and not any(p.name.startswith("gradio") for p in tmp_path.iterdir())


def test_a_transformers_folder_races_prompts(tmp_path):
    """``relaxspec demo --model-path DIR``: the page takes a prompt; the AR lane paints what
    ``relaxspec.generate(model_path=..., prompts=[...])`` paints with the same seed, and a bad
    prompt is the status line."""
    import threading

    from helpers.emu3 import emu3_folder_at
    from relaxspec.cli import build_parser
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    folder = emu3_folder_at(tmp_path / "emu3")
    args = build_parser().parse_args(["demo", "--model-path", str(folder), "--image-size", "32", "--prompt",
                                      "a red fox"])
    model = load_demo_model(args)
    assert model.prompts and model.default_method == "gsd" and model.default_class == "a red fox"
    history: list = []
    (tmp_path / "out").mkdir()
    updates = read_race(race_handler(model, tmp_path / "out", history, threading.Lock(), "a lighthouse", "sjd", None,
                                     3, None))
    ar_image, ar_text, my_image, my_text, heat, gallery, status = updates[-1]
    assert status.startswith("done: sjd") and ar_image.shape == my_image.shape and "target forwards: 16" in ar_text
    plain = relaxspec.generate(prompts=["a lighthouse"], model_path=str(folder), method="ar", image_size=32, seed=3,
                               upscale=ar_image.shape[0] // 8)
    assert (np.asarray(plain.images[0]) == ar_image).all()
    empty = list(race_handler(model, tmp_path / "out", history, threading.Lock(), "  ", "sjd", None, 3, None))
    assert empty[-1][-1] == "**Not run:** write a prompt"


def test_official_lanterns_llamagen_t2i_folder_races_prompts(tmp_path, tiny_ckpts):
    """``relaxspec demo --gpt-ckpt LlamaGen-T2I --vq-ckpt ... --t5-path ...`` (issue 29): a LlamaGen
    text-to-image model, here the tiny replica of official LANTERN's folder, serves a prompt box
    and races prompts; its AR lane paints generate's image of the same prompt and seed."""
    import threading

    from helpers.t5 import make_t5
    from relaxspec.cli import build_parser, main
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    folder = Path(__file__).resolve().parent / "data" / "lantern" / "llamagen-t2i"
    t5 = make_t5(tmp_path / "t5", d_model=16)
    vq = ["--vq-ckpt", tiny_ckpts["t2i"]["vq"], "--vq-model", tiny_ckpts["t2i"]["vq_json"]]
    args = build_parser().parse_args(["demo", "--gpt-ckpt", str(folder), *vq, "--t5-path", str(t5), "--prompt",
                                      "a red cat"])
    model = load_demo_model(args)
    assert model.prompts and model.default_class == "a red cat" and model.default_method == "gsd"
    from relaxspec.demo.app import check_handler

    encoded = []  # the check before a race is queued does not run the text encoder
    encode = model.pipeline.encode
    model.pipeline.encode = lambda prompts: encoded.append(prompts) or encode(prompts)
    assert check_handler(model, "the big blue dog", "sjd", "", 2, None)[1] is True
    assert check_handler(model, "  ", "sjd", "", 2, None) == ("**Not run:** write a prompt", False)
    assert encoded == []
    (tmp_path / "out").mkdir()
    updates = read_race(race_handler(model, tmp_path / "out", [], threading.Lock(), "the big blue dog", "sjd", None,
                                     2, None))
    ar_image, _, my_image, _, _, _, status = updates[-1]
    assert status.startswith("done: sjd") and ar_image.shape == my_image.shape
    assert encoded == [["the big blue dog"]]  # the race encodes it
    assert main(["generate", "--gpt-ckpt", str(folder), *vq, "--t5-path", str(t5), "--prompt", "the big blue dog",
                 "--method", "ar", "--seed", "2", "--upscale", str(ar_image.shape[0] // 16), "--no-progress",
                 "--out", str(tmp_path / "g")]) == 0
    from PIL import Image

    assert (np.asarray(Image.open(tmp_path / "g" / "0000.png")) == ar_image).all()
    with pytest.raises(RelaxspecError, match="needs --t5-path DIR"):
        load_demo_model(build_parser().parse_args(["demo", "--gpt-ckpt", str(folder), *vq]))
