"""The web page in a real headless browser (Debian's chromium + chromium-driver, through selenium), against a real
`python -m strata_jax serve` of the demo model with an API key: the page asks for the key, a prompt streams an
answer, Stop ends the stream (and the server cancels the request), the monitor updates, code blocks render.
Skips, saying why, without chromium, chromedriver or selenium. `STRATA_WEB_SCREENSHOT=PATH` also saves the final
page there (docs/web-ui.png was made so)."""

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

KEY = "web-ui-test-key"
CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser_paths() -> tuple[str, str]:
    browser = next((path for name in CHROMIUMS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("needs a headless Chromium and its driver: `apt-get install chromium chromium-driver` "
                    "(.ci/run installs them); found browser=%s, chromedriver=%s" % (browser, driver))
    return browser, driver


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("STRATA_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_jax", "serve", "--port", "0", "--slots", "2", "--ctx", "4096",
         "--served-name", "demo", "--api-key", KEY],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    url = None
    deadline = time.monotonic() + 600
    while url is None and time.monotonic() < deadline:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            break
        seen.append(line)
        if m := re.match(r"^listening on (http://\S+)$", line):
            url = m.group(1)
    if url is None:
        proc.kill()
        pytest.fail("serve did not start:\n" + "".join(seen))
    yield {"url": url, "startup": "".join(seen), "lines": lines, "seen": seen}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def _number(driver, element_id: str) -> float:
    """An element's text as a number (0 while it shows none, e.g. "-" before the first poll)."""
    try:
        return float(driver.find_element("id", element_id).text)
    except ValueError:
        return 0.0


def _set(driver, field: str, value: str) -> None:
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element("id", "set-" + field)
    el.clear()
    el.send_keys(value, Keys.TAB)  # the change event stores it


def _text(driver, css: str) -> str:
    found = driver.find_elements("css selector", css)
    return found[-1].text if found else ""


def _updates(driver) -> int:
    return int(driver.find_element("id", "mon-updated").get_attribute("data-count") or 0)


def test_the_page_chats_stops_and_monitors(server, browser, tmp_path):
    driver, url = browser, server["url"]
    assert f"ANTHROPIC_BASE_URL={url} ANTHROPIC_AUTH_TOKEN=<your --api-key> ANTHROPIC_MODEL=demo" in server["startup"]
    assert f"web UI    {url}/" in server["startup"]
    driver.get(url + "/")
    assert driver.title == "strata_jax"
    # The server has a key: the monitor says so until the key is entered in the settings.
    _wait(lambda: driver.find_element("id", "status").text == "key needed", 20, "the monitor to ask for the key")
    driver.find_element("id", "settings-toggle").click()
    _set(driver, "key", KEY)
    _wait(lambda: driver.find_element("id", "status").text == "ready", 20, "the monitor to read /v1/monitor")
    assert driver.find_element("id", "model-name").text == "demo"
    assert driver.find_element("id", "mon-slots").text == "0 / 2"
    assert "context per slot" in driver.find_element("id", "mon-plan").text

    # Sampled hot the demo model rambles for hundreds of tokens: time to see it stream and to stop it. It can still
    # end its turn early now and then; then the attempt is repeated.
    _set(driver, "temperature", "2")
    _set(driver, "top-p", "1")
    _set(driver, "max-tokens", "3000")
    for attempt in range(4):
        driver.find_element("id", "clear").click()
        driver.find_element("id", "prompt").send_keys("Tell me a long story about a robot.\n")
        first = _wait(lambda: _text(driver, ".msg.assistant .body"), 60, "the first streamed text")
        _wait(lambda: len(_text(driver, ".msg.assistant .body")) > len(first) or
              "finish:" in _text(driver, ".msg.assistant .meta"), 30, "more streamed text")
        in_flight = _wait(lambda: "generating" in driver.find_element("id", "mon-requests").text or
                          "finish:" in _text(driver, ".msg.assistant .meta"), 10, "the monitor to show the request")
        if "finish:" in _text(driver, ".msg.assistant .meta"):
            continue  # ended by itself before Stop: try again
        assert in_flight and "openai" in driver.find_element("id", "mon-requests").text
        # The monitor's poll that showed the request may predate its first tokens: its rate shows on a later poll.
        _wait(lambda: _number(driver, "mon-tok-s") > 0 or "finish:" in _text(driver, ".msg.assistant .meta"), 10,
              "the monitor's tok/s to count the streamed tokens")
        if "finish:" in _text(driver, ".msg.assistant .meta"):
            continue
        driver.find_element("id", "stop").click()
        meta = _wait(lambda: _text(driver, ".msg.assistant .meta"), 10, "the answer's footer")
        if "finish:" in meta:
            continue  # it ended just before the click
        break
    else:
        pytest.fail("the demo model ended every answer before Stop could be pressed")
    assert "stopped" in meta
    _wait(lambda: driver.find_element("id", "send").is_enabled(), 10, "Send to be enabled again")
    assert not driver.find_element("id", "stop").is_enabled()
    stopped_text = _text(driver, ".msg.assistant .body")
    time.sleep(1.5)
    assert _text(driver, ".msg.assistant .body") == stopped_text, "text kept arriving after Stop"
    # The server cancelled the request: the monitor lists it as such and no slot stays busy.
    _wait(lambda: "cancelled (client gone)" in driver.find_element("id", "mon-recent").text, 15,
          "the monitor to list the stopped request")
    _wait(lambda: driver.find_element("id", "mon-slots").text == "0 / 2", 15, "the slot to be freed")
    assert int(driver.find_element("id", "mon-requests-total").text.replace(",", "")) >= 1
    seen_updates = _updates(driver)
    _wait(lambda: _updates(driver) >= seen_updates + 2, 10, "the monitor to keep updating")

    # A greedy question: the answer streams to its end with its code block rendered.
    driver.find_element("id", "clear").click()
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "300")
    driver.find_element("id", "prompt").send_keys("Explain Python decorators with several code examples.\n")
    meta = _wait(lambda: "finish:" in _text(driver, ".msg.assistant .meta") and
                 _text(driver, ".msg.assistant .meta"), 120, "the greedy answer to finish")
    assert "first token" in meta and "tokens" in meta
    code = driver.find_elements("css selector", ".msg.assistant .code pre code")
    assert code and "def " in code[0].text, _text(driver, ".msg.assistant .body")
    rendered = driver.execute_script("return renderMarkdown(arguments[0]);",
                                     "**bold** `x<y`\n\n```py\n<script>1</script>\n")
    assert "<strong>bold</strong>" in rendered and "<code>x&lt;y</code>" in rendered
    assert '<div class="code open">' in rendered and "&lt;script&gt;" in rendered  # an unclosed fence, escaped

    seen_updates = _updates(driver)
    _wait(lambda: _updates(driver) >= seen_updates + 1, 10, "a monitor update")
    _wait(lambda: driver.find_element("id", "mon-recent").text.count("openai") >= 2, 10,
          "both requests in the monitor")
    driver.find_element("id", "settings-toggle").click()  # closed, for the picture
    assert not driver.find_element("id", "settings").is_displayed()
    driver.save_screenshot(str(tmp_path / "web-ui.png"))
    if os.environ.get("STRATA_WEB_SCREENSHOT"):
        Path(os.environ["STRATA_WEB_SCREENSHOT"]).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(os.environ["STRATA_WEB_SCREENSHOT"])
    # The server logged one line per request, the stopped one as cancelled.
    logged = "".join(server["seen"]) + "".join(_drain(server["lines"]))
    assert re.search(r"strata\.requests INFO req_\w+ openai: prompt \d+ tokens \(\d+ cached\), output \d+, .*"
                     r"stop cancelled \(client gone\)", logged), logged[-3000:]


def _drain(lines: queue.Queue) -> list[str]:
    out = []
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return out
        if line is None:
            return out
        out.append(line)
