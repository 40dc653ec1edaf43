"""The Monitor page in headless Chromium (Debian's package, driven by Playwright)."""
import os
import shutil

import pytest
from openai import OpenAI

from strata.server import create_app
from tests.server.helpers import LiveServer

CHROMIUM = os.environ.get("STRATA_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_monitor(browser, url):
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    return page, errors


def test_monitor_shows_state_and_updates_after_a_request(browser, server, llm, tmp_path):
    page, errors = open_monitor(browser, server.url)
    expect = playwright.expect
    expect(page.locator("#model-name")).to_have_text(llm.model_name)
    expect(page.locator("#device")).to_have_text(llm.device)
    expect(page.locator("#state")).to_have_text("idle")
    expect(page.locator("#conn")).to_have_text("live")
    # The CPU backend says so instead of showing zeros; the prompt-chunk row still reports the last prompt.
    expect(page.locator("#gpu-cpu-note")).to_be_visible()
    expect(page.locator("#gpu-body")).to_be_hidden()
    before = int(page.locator("#total-requests").inner_text().replace(",", ""))

    reply = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model=llm.model_name, prompt="Monitor me, please.", max_tokens=6, temperature=0)
    expect(page.locator("#total-requests")).to_have_text(str(before + 1))
    read = reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens
    expect(page.locator("#prompt-chunk")).to_have_text(f"chunk {read} tokens · ring n/a")   # one chunk on CPU
    first_row = page.locator("#requests tbody tr").first
    expect(first_row).to_contain_text("completion")
    assert first_row.locator("td").nth(4).inner_text() == "6"        # output tokens

    # The chat box streams a reply, and its request lands in the table.
    page.fill("#chat-max", "5")
    page.fill("#chat-input", "Hello from the browser")
    page.click("#chat-send")
    expect(page.locator(".msg.assistant .meta")).to_contain_text("5 tokens")
    expect(page.locator("#total-requests")).to_have_text(str(before + 2))
    expect(page.locator("#requests tbody tr").first).to_contain_text("chat")
    page.screenshot(path=str(tmp_path / "monitor.png"), full_page=True)
    assert (tmp_path / "monitor.png").stat().st_size > 10_000
    assert errors == []
    page.close()


class GpuStatusLLM:
    """The CPU model reporting a GPU engine's status, to check the GPU panel's layout (split: a layer
    split's status over two cards)."""

    def __init__(self, llm, split: bool = False):
        self._llm = llm
        self._split = split

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def status(self):
        gib = 1 << 30
        kept = {**self._llm.status()["kept_conversations"], "shared_prefixes": 3, "shared_tokens": 4096}
        return {**self._llm.status(), "device": "cuda", "prefill_chunk": 2048, "prefill_ring": 12,
                "kept_conversations": kept,
                "gpu": {"name": "NVIDIA H200", "vram_budget_bytes": 24 * gib, "vram_used_bytes": 22 * gib,
                        "dense_bytes": 3 * gib, "expert_cache_bytes": 16 * gib, "kv_bytes": 2 * gib,
                        "prompt_bytes": 1 * gib},
                "expert_cache": {"slots": 1536, "resident": 1536, "total_experts": 6144, "hits": 900,
                                 "misses": 100, "hit_rate": 0.9},
                "bytes_h2d": 123 * gib,
                **({"layer_split": {"counts": [19, 29], "handoff_ms_per_step": 0.0412,
                                    "cards": [{"gpu": 0, "layers": [0, 19]}, {"gpu": 1, "layers": [19, 48]}]}}
                   if self._split else {})}


def test_monitor_gpu_panel_fields(browser, llm, tmp_path):
    from tests.server.helpers import endless_llm
    live = LiveServer(create_app(GpuStatusLLM(endless_llm(llm.pack.path, parallel=4, batch_max=2))))
    try:
        page, errors = open_monitor(browser, live.url)
        expect = playwright.expect
        expect(page.locator("#device")).to_have_text("cuda")
        expect(page.locator("#gpu-body")).to_be_visible()
        expect(page.locator("#gpu-cpu-note")).to_be_hidden()
        expect(page.locator("#gpu-name")).to_have_text("NVIDIA H200")
        rows = page.locator("#gpu-rows")
        for text in ("Dense weights", "3.00 GiB", "Expert cache", "16.00 GiB · 1,536 slots", "KV cache",
                     "Prompt path", "Experts in VRAM", "1,536 / 6,144", "Hit rate", "90.0 %",
                     "PCIe host → device", "123 GiB · 0.00 GB/s"):
            expect(rows).to_contain_text(text)
        expect(page.locator("#vram-legend")).to_contain_text("22.00 GiB used of 24.00 GiB")
        expect(page.locator("#prompt-chunk")).to_have_text("chunk 2,048 tokens · ring 12 slots")
        expect(page.locator("#batching")).to_have_text("slots 0 / 4 busy · steps of up to 2 rows (--batch-max 2) · "
                                                       "3 prefixes copied between slots (4,096 tokens)")
        page.screenshot(path=str(tmp_path / "monitor_gpu.png"), full_page=True)
        assert errors == []
        page.close()
    finally:
        live.close()


def test_monitor_shows_a_layer_split(browser, llm):
    from tests.server.helpers import endless_llm
    live = LiveServer(create_app(GpuStatusLLM(endless_llm(llm.pack.path), split=True)))
    try:
        page, errors = open_monitor(browser, live.url)
        playwright.expect(page.locator("#gpu-rows")).to_contain_text(
            "Layer split" + "layers 0–18 on GPU 0, layers 19–47 on GPU 1 · hand-off 0.041 ms a step")
        assert errors == []
        page.close()
    finally:
        live.close()
