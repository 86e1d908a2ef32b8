"""The page at ``/`` in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven through
Selenium): type a sentence, press Translate, read the translation and the attention map back."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import make_checkpoint, sentence_lines
from service import Service

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    if os.environ.get("CI"):  # CI installs them (.ci/run): their absence there is a failure, not a skip
        raise RuntimeError("the browser tests need chromium and chromium-driver (apt-get install chromium "
                           "chromium-driver)")
    pytest.skip("no chromium/chromedriver here (apt-get install chromium chromium-driver)", allow_module_level=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = Service(make_checkpoint(tmp_path_factory.mktemp("page")), "--max-len-b", "12", "--allow-alignment")
    yield s
    assert s.stop() == 0


def test_the_page_runs_under_its_content_security_policy(service):
    status, page, headers = service.request("/")
    csp = headers["content-security-policy"]
    assert status == 200 and "script-src 'sha256-" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp and headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff" and "server" not in {k.lower() for k in headers}
    # the page's translations below run in a browser that enforces this policy


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=DriverService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def translate_on_the_page(browser, url: str, text: str, attention: bool = False) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/")
    WebDriverWait(browser, 30).until(lambda d: "\u2192" in d.find_element(By.ID, "model").text)
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys(text)
    if attention != browser.find_element(By.ID, "show-attention").is_selected():
        browser.find_element(By.ID, "show-attention").click()
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "status").text.endswith(" ms")
                                     or d.find_element(By.ID, "error").text)
    assert browser.find_element(By.ID, "error").text == ""
    return browser.find_element(By.ID, "translation").text


def test_typing_a_sentence_shows_its_translation(service, browser):
    from attnmt import Translator

    lines = sentence_lines(2, 31)
    with Translator(str(service.ckpt), max_len_b=12, threads=1) as t:
        expected = t.translate(lines)
    from selenium.webdriver.common.by import By

    assert translate_on_the_page(browser, service.url, lines[0]) == expected[0]
    assert "en \u2192 de" in browser.find_element(By.ID, "model").text
    # two lines: two translations, in order
    assert translate_on_the_page(browser, service.url, "\n".join(lines)).split("\n") == expected


def test_the_attention_map_has_a_row_per_target_token_and_a_column_per_source_token(service, browser):
    from selenium.webdriver.common.by import By

    from attnmt import Translator

    line = sentence_lines(1, 32)[0]
    with Translator(str(service.ckpt), max_len_b=12, threads=1) as t:
        expected = t.translate(line, alignment=True)
    assert translate_on_the_page(browser, service.url, line, attention=True) == expected.text
    table = browser.find_element(By.CSS_SELECTOR, "#attention table.attention")
    heads = [th.text for th in table.find_elements(By.CSS_SELECTOR, "thead th")][1:]
    rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(heads) == len(expected.alignment.source_tokens)
    assert [r.find_element(By.TAG_NAME, "th").text for r in rows] == expected.alignment.target_tokens
    if os.environ.get("ATTNMT_PAGE_SCREENSHOT"):  # docs/serve-page.png is taken this way
        browser.save_screenshot(os.environ["ATTNMT_PAGE_SCREENSHOT"])


def test_an_error_of_the_service_is_shown_on_the_page(service, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(service.url + "/")
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys("word " * 150)
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)
    assert "at most 96" in browser.find_element(By.ID, "error").text
