#!/usr/bin/env python3
"""The chat page at `/` in headless Chromium, driven by Selenium as a person would use it: the
server's API key typed into the page, a message typed and sent with Enter, the answer streamed
into the page, a second turn that carries the first (the server counts its longer prompt), Stop
in the middle of a long answer (the server cancels the generation), New chat, and no console
errors. Saves a screenshot. Usage:
    chat-page-check.py BASE_URL API_KEY MODEL SCREENSHOT
BASE_URL is the OpenAI base (ending /v1). Prints one line per check and ends with
'chat-page-check: N passed, M failed'."""

import re
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

base, key, model, screenshot = sys.argv[1:5]
root = base.removesuffix("/v1")
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


def metric(name):
    req = urllib.request.Request(f"{root}/metrics", headers={"Authorization": f"Bearer {key}"})
    text = urllib.request.urlopen(req).read().decode()
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


options = webdriver.ChromeOptions()
options.binary_location = "/usr/bin/chromium"
for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--window-size=420,800"):
    options.add_argument(flag)
options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
wait = WebDriverWait(driver, 120)
try:
    driver.get(root + "/")
    wait.until(lambda d: d.find_element(By.ID, "keyform").is_displayed())
    check("the page asks for the key", True)
    driver.find_element(By.ID, "key").send_keys(key + Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "model").text == model)
    check("the key opens the status line", True, driver.find_element(By.ID, "speed").text)

    settings = driver.find_element(By.ID, "settings")
    settings.find_element(By.TAG_NAME, "summary").click()
    for field, value in (("temperature", "0"), ("max_tokens", "8")):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)

    def answers():
        return driver.find_elements(By.CSS_SELECTOR, ".assistant")

    def turn(text):
        before = metric("sluice_prompt_tokens_total")
        n = len(answers())
        driver.find_element(By.ID, "prompt").send_keys(text + Keys.ENTER)
        wait.until(lambda d: len(answers()) == n + 1 and answers()[-1].get_attribute("data-done") == "true")
        return answers()[-1].find_element(By.CLASS_NAME, "answer").text, metric("sluice_prompt_tokens_total") - before

    first, first_tokens = turn("Hello")
    check("a streamed answer appears", first != "" and driver.find_elements(By.CSS_SELECTOR, ".user")[0].text == "Hello", repr(first))
    second, second_tokens = turn("And once more")
    check("the second turn carries the first", second_tokens > first_tokens + 3, f"{first_tokens} then {second_tokens} prompt tokens")

    box = driver.find_element(By.ID, "max_tokens")
    box.clear()
    box.send_keys("3000")
    cancelled = metric("sluice_generations_cancelled_total")
    driver.find_element(By.ID, "prompt").send_keys("Tell a long story" + Keys.ENTER)
    wait.until(lambda d: len(answers()) == 3 and len(answers()[-1].find_element(By.CLASS_NAME, "answer").text) > 4)
    driver.find_element(By.ID, "stop").click()
    wait.until(lambda d: answers()[-1].get_attribute("data-done") == "true")
    deadline = time.time() + 60
    while metric("sluice_generations_cancelled_total") <= cancelled and time.time() < deadline:
        time.sleep(0.1)
    check("stop ends the answer and the generation", metric("sluice_generations_cancelled_total") > cancelled
          and driver.find_element(By.ID, "stop").get_attribute("disabled") is not None)
    driver.save_screenshot(screenshot)

    driver.find_element(By.ID, "new").click()
    check("new chat empties the conversation", answers() == [])
    # The first status request, before the key was given, is refused: that one is expected.
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "status of 401" not in e["message"]]
    check("no console errors", errors == [], repr(errors))
finally:
    driver.quit()

failed = checks.count(False)
print(f"chat-page-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
