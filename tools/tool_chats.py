"""Seeded synthetic tool-call chats for the demo model, in exactly the text the server builds.

Each chat offers a few made-up functions (the right one and some others, in a shuffled order), asks
something whose arguments are spelled out in the user's message, and the assistant answers with one
`<tool_call>` block whose arguments copy them; a tool message brings a result, and a final assistant
turn answers with it. Some chats offer tools where the right answer is plain text (a greeting, a
question no offered tool answers, "which tools do you have?").

The text is rendered the way `python -m strata serve` renders a chat request with `tools` for a
template without a tools section (the demo's ChatML): strata.server.tools.render_messages puts the
tool list in a system message and turns calls and results into text, then the pack's own chat template
renders the messages. So a fine-tune on these chats trains on the prompts the server really sends.

    PYTHONPATH=. python tools/tool_chats.py --n 4 --show      # print a few chats
    PYTHONPATH=. python tools/tool_chats.py OUT --n 480       # OUT/tool_chats.json: chats, token ids, loss masks

`chats(n, seed)` returns dicts with "messages" and "tools" (the OpenAI request's), "prompt" (the text up
to the assistant's first turn, as the server sends it), "text" (the whole conversation) and "call"
(the expected {"name", "arguments"}, or None for a plain-text answer).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "strata" / "demo"
SEED = 20251202
HELD_OUT_SEED = 777
SYSTEM_PROMPT = "You are a helpful assistant."

CITIES = ["Oslo", "Paris", "Tokyo", "Lima", "Cairo", "Berlin", "Madrid", "Rome", "Dublin", "Nairobi", "Sydney",
          "Toronto", "Chicago", "Denver", "Boston", "Seattle", "Mumbai", "Delhi", "Seoul", "Hanoi", "Lagos",
          "Quito", "Vienna", "Prague", "Warsaw", "Lisbon", "Athens", "Helsinki", "Bergen", "Kyoto", "Osaka",
          "Austin", "Dallas", "Miami", "Havana", "Bogota", "Santiago", "Manila", "Jakarta", "Perth", "Zurich",
          "Geneva", "Munich", "Hamburg", "Milan", "Naples", "Porto", "Seville", "Krakow", "Riga"]
COUNTRIES = {"France": ("Paris", 68), "Japan": ("Tokyo", 124), "Peru": ("Lima", 34), "Egypt": ("Cairo", 112),
             "Germany": ("Berlin", 84), "Spain": ("Madrid", 48), "Italy": ("Rome", 59), "Ireland": ("Dublin", 5),
             "Kenya": ("Nairobi", 55), "Norway": ("Oslo", 6), "Austria": ("Vienna", 9), "Poland": ("Warsaw", 37),
             "Portugal": ("Lisbon", 10), "Greece": ("Athens", 10), "Finland": ("Helsinki", 6),
             "Chile": ("Santiago", 20), "Cuba": ("Havana", 11), "Latvia": ("Riga", 2), "Canada": ("Ottawa", 40),
             "Brazil": ("Brasilia", 216), "India": ("New Delhi", 1428), "Mexico": ("Mexico City", 128)}
WORDS = ["apple", "river", "window", "garden", "silver", "planet", "basket", "candle", "forest", "bridge",
         "pencil", "rocket", "mirror", "island", "ladder", "spring", "thunder", "velvet", "harbor", "lantern"]
DEFINITIONS = {"apple": "a round fruit with red or green skin", "river": "a large natural stream of water",
               "window": "an opening in a wall that lets in light", "garden": "a piece of ground where plants grow",
               "silver": "a shiny grey-white metal", "planet": "a large body that moves around a star",
               "basket": "a container made of woven strips", "candle": "a stick of wax with a wick that burns",
               "forest": "a large area covered with trees", "bridge": "a structure that carries a road over water",
               "pencil": "a thin tool for writing with graphite", "rocket": "a vehicle pushed by burning fuel",
               "mirror": "a surface that reflects light", "island": "land surrounded by water",
               "ladder": "a set of steps between two long side pieces", "spring": "the season after winter",
               "thunder": "the loud sound that follows lightning", "velvet": "a soft cloth with a thick pile",
               "harbor": "a sheltered place for ships", "lantern": "a lamp with a protective case"}
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
         "peggy", "trent", "victor", "walter"]
DIRS = ["/home/alice/docs", "/var/log", "/etc", "/tmp/build", "/srv/data", "/home/bob/src", "/opt/app", "/data/raw",
        "/home/carol/notes", "/usr/share/doc"]
FILES = ["notes.txt", "todo.md", "config.ini", "report.csv", "main.py", "README.md", "app.log", "setup.cfg",
         "data.json", "index.html", "schedule.txt", "recipe.txt"]
CONTENTS = ["buy milk and eggs", "meeting at 10 on Monday", "port = 8080", "total,42", "print('hello')",
            "A small example project.", "ERROR disk full", "name = demo", "{\"ok\": true}", "<h1>Welcome</h1>",
            "gym on Tuesday", "two cups of flour"]
SYMBOLS = {"ACME": 132.5, "GLOBEX": 48.25, "INITECH": 17.8, "UMBRELLA": 250.0, "HOOLI": 88.4, "STARK": 312.75,
           "WAYNE": 140.1, "TYRELL": 66.6}
CURRENCIES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CHF": 0.88, "CAD": 1.36, "NOK": 10.7,
              "SEK": 10.5, "INR": 83.2, "AUD": 1.52}
LANGUAGES = {"French": {"hello": "bonjour", "thank you": "merci", "good night": "bonne nuit", "cat": "chat",
                        "water": "eau", "friend": "ami"},
             "Spanish": {"hello": "hola", "thank you": "gracias", "good night": "buenas noches", "cat": "gato",
                         "water": "agua", "friend": "amigo"},
             "German": {"hello": "hallo", "thank you": "danke", "good night": "gute Nacht", "cat": "Katze",
                        "water": "Wasser", "friend": "Freund"},
             "Italian": {"hello": "ciao", "thank you": "grazie", "good night": "buona notte", "cat": "gatto",
                         "water": "acqua", "friend": "amico"}}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy", "clear"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
LENGTH = {"km": 1000.0, "m": 1.0, "cm": 0.01, "mi": 1609.344, "ft": 0.3048, "in": 0.0254}
WEIGHT = {"kg": 1.0, "g": 0.001, "lb": 0.45359237, "oz": 0.028349523}


def _num(x: float):
    """A result as a short number: an int when whole, else rounded to 2 places."""
    x = round(float(x), 2)
    return int(x) if x == int(x) else x


def _date(r: random.Random) -> str:
    return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def _days(a: str, b: str) -> int:
    import datetime
    return (datetime.date.fromisoformat(b) - datetime.date.fromisoformat(a)).days


def _prop(kind: str, desc: str, **kw) -> dict:
    return {"type": kind, "description": desc, **kw}


def _fn(name, desc, props: dict, asks, args, result, answer, required=None):
    """One made-up function: its OpenAI definition, user phrasings ({arg} slots), an argument sampler
    (rng -> dict), the result it returns (args -> dict) and the final answer (args, result -> text)."""
    params = {"type": "object", "properties": props, "required": list(required or props)}
    return {"def": {"type": "function", "function": {"name": name, "description": desc, "parameters": params}},
            "asks": asks, "args": args, "result": result, "answer": answer}


def _arith(name, word, sym, op, asks):
    return _fn(name, f"{word.capitalize()} two numbers", {"a": _prop("number", "the first number"),
                                                         "b": _prop("number", "the second number")},
               asks, lambda r: {"a": r.randint(2, 999), "b": r.randint(2, 99)},
               lambda a: {"result": _num(op(a["a"], a["b"]))},
               lambda a, res: f"{a['a']} {sym} {a['b']} = {res['result']}.")


def _convert(name, what, table):
    units = list(table)
    return _fn(name, f"Convert a {what} from one unit to another",
               {"value": _prop("number", "the amount"), "from_unit": _prop("string", "the unit it is in", enum=units),
                "to_unit": _prop("string", "the unit wanted", enum=units)},
               ["Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?",
                "What is {value} {from_unit} in {to_unit}?"],
               lambda r: dict(zip(("value", "from_unit", "to_unit"), [r.randint(1, 500), *r.sample(units, 2)])),
               lambda a: {"value": _num(a["value"] * table[a["from_unit"]] / table[a["to_unit"]]),
                          "unit": a["to_unit"]},
               lambda a, res: f"{a['value']} {a['from_unit']} is {res['value']} {a['to_unit']}.")


def _temp(a):
    c = {"C": lambda v: v, "F": lambda v: (v - 32) * 5 / 9, "K": lambda v: v - 273.15}[a["from_unit"]](a["value"])
    return {"C": c, "F": c * 9 / 5 + 32, "K": c + 273.15}[a["to_unit"]]


def _weather_args(r):
    return {"city": r.choice(CITIES), "unit": r.choice(["C", "F"])}


def _weather_result(a):
    h = sum(map(ord, a["city"]))
    c = h % 30 - 3
    return {"city": a["city"], "temperature": c if a["unit"] == "C" else round(c * 9 / 5 + 32),
            "unit": a["unit"], "conditions": CONDITIONS[h % len(CONDITIONS)]}


def _path(r):
    return f"{r.choice(DIRS)}/{r.choice(FILES)}"


def _content(path: str) -> str:
    return CONTENTS[sum(map(ord, path)) % len(CONTENTS)]


def _listing(d: str) -> list[str]:
    h = sum(map(ord, d))
    return [FILES[(h + 3 * i) % len(FILES)] for i in range(2 + h % 3)]


def _text(r):
    return " ".join(r.sample(WORDS, r.randint(2, 5)))


FUNCTIONS = [
    _fn("get_weather", "The current weather of a city",
        {"city": _prop("string", "the city name"), "unit": _prop("string", "C or F", enum=["C", "F"])},
        ["What is the weather in {city}? Use {unit}.", "How warm is it in {city} right now, in {unit}?",
         "Weather for {city} please, unit {unit}.", "Is it cold in {city}? Give me the temperature in {unit}."],
        _weather_args, _weather_result,
        lambda a, res: f"It is {res['temperature']}°{a['unit']} and {res['conditions']} in {a['city']}."),
    _fn("get_time", "The local time in a city", {"city": _prop("string", "the city name")},
        ["What time is it in {city}?", "Tell me the local time in {city}.", "Current time in {city}?"],
        lambda r: {"city": r.choice(CITIES)},
        lambda a: {"city": a["city"], "time": f"{sum(map(ord, a['city'])) % 24:02d}:{len(a['city']) * 7 % 60:02d}"},
        lambda a, res: f"It is {res['time']} in {a['city']}."),
    _arith("add", "add", "+", lambda x, y: x + y, ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."]),
    _arith("subtract", "subtract", "-", lambda x, y: x - y,
           ["What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}."]),
    _arith("multiply", "multiply", "*", lambda x, y: x * y,
           ["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}."]),
    _arith("divide", "divide", "/", lambda x, y: x / y,
           ["What is {a} divided by {b}?", "Divide {a} by {b}.", "Compute {a} / {b}."]),
    _fn("power", "Raise a number to a power", {"base": _prop("integer", "the base"),
                                               "exponent": _prop("integer", "the exponent")},
        ["What is {base} to the power of {exponent}?", "Compute {base} ** {exponent}.", "Raise {base} to {exponent}."],
        lambda r: {"base": r.randint(2, 12), "exponent": r.randint(2, 6)},
        lambda a: {"result": a["base"] ** a["exponent"]},
        lambda a, res: f"{a['base']} to the power of {a['exponent']} is {res['result']}."),
    _fn("square_root", "The square root of a number", {"x": _prop("number", "a number, at least 0")},
        ["What is the square root of {x}?", "Square root of {x}?", "Compute sqrt({x})."],
        lambda r: {"x": r.randint(2, 9999)}, lambda a: {"result": _num(a["x"] ** 0.5)},
        lambda a, res: f"The square root of {a['x']} is {res['result']}."),
    _fn("is_prime", "Whether an integer is prime", {"n": _prop("integer", "the number to test")},
        ["Is {n} a prime number?", "Check whether {n} is prime.", "Is {n} prime?"],
        lambda r: {"n": r.randint(2, 5000)},
        lambda a: {"n": a["n"], "prime": all(a["n"] % d for d in range(2, int(a["n"] ** 0.5) + 1))},
        lambda a, res: f"{a['n']} is {'a prime' if res['prime'] else 'not a prime'} number."),
    _convert("convert_length", "length", LENGTH),
    _convert("convert_weight", "weight", WEIGHT),
    _fn("convert_temperature", "Convert a temperature between C, F and K",
        {"value": _prop("number", "the temperature"), "from_unit": _prop("string", "C, F or K", enum=["C", "F", "K"]),
         "to_unit": _prop("string", "C, F or K", enum=["C", "F", "K"])},
        ["Convert {value} degrees {from_unit} to {to_unit}.", "What is {value} {from_unit} in {to_unit}?",
         "{value} {from_unit} is how much in {to_unit}?"],
        lambda r: dict(zip(("value", "from_unit", "to_unit"), [r.randint(-20, 120), *r.sample(["C", "F", "K"], 2)])),
        lambda a: {"value": _num(_temp(a)), "unit": a["to_unit"]},
        lambda a, res: f"{a['value']} {a['from_unit']} is {res['value']} {a['to_unit']}."),
    _fn("convert_currency", "Convert money from one currency to another",
        {"amount": _prop("number", "the amount"), "from_currency": _prop("string", "a currency code like USD"),
         "to_currency": _prop("string", "a currency code like EUR")},
        ["Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in {to_currency}?",
         "I have {amount} {from_currency}. What is that in {to_currency}?"],
        lambda r: dict(zip(("amount", "from_currency", "to_currency"), [r.randint(1, 2000), *r.sample(list(CURRENCIES), 2)])),
        lambda a: {"amount": _num(a["amount"] / CURRENCIES[a["from_currency"]] * CURRENCIES[a["to_currency"]]),
                   "currency": a["to_currency"]},
        lambda a, res: f"{a['amount']} {a['from_currency']} is {res['amount']} {a['to_currency']}."),
    _fn("get_exchange_rate", "The exchange rate between two currencies",
        {"base": _prop("string", "the currency to convert from"), "quote": _prop("string", "the currency to convert to")},
        ["What is the exchange rate from {base} to {quote}?", "Exchange rate {base} to {quote}?",
         "How many {quote} do I get for one {base}?"],
        lambda r: dict(zip(("base", "quote"), r.sample(list(CURRENCIES), 2))),
        lambda a: {"rate": round(CURRENCIES[a["quote"]] / CURRENCIES[a["base"]], 4)},
        lambda a, res: f"One {a['base']} is {res['rate']} {a['quote']}."),
    _fn("get_stock_price", "The latest price of a stock", {"symbol": _prop("string", "the ticker symbol")},
        ["What is the price of {symbol} stock?", "How much is {symbol} trading at?", "Stock price of {symbol}?"],
        lambda r: {"symbol": r.choice(list(SYMBOLS))},
        lambda a: {"symbol": a["symbol"], "price": SYMBOLS[a["symbol"]], "currency": "USD"},
        lambda a, res: f"{a['symbol']} is trading at {res['price']} USD."),
    _fn("read_file", "Read a text file", {"path": _prop("string", "the file's path")},
        ["What is in the file {path}?", "Read {path} for me.", "Show me the contents of {path}.",
         "Open {path} and tell me what it says."],
        lambda r: {"path": _path(r)}, lambda a: {"path": a["path"], "content": _content(a["path"])},
        lambda a, res: f"The file {a['path']} says: {res['content']}"),
    _fn("list_directory", "List the files in a directory", {"path": _prop("string", "the directory")},
        ["Which files are in {path}?", "List the directory {path}.", "What does {path} contain?"],
        lambda r: {"path": r.choice(DIRS)}, lambda a: {"files": _listing(a["path"])},
        lambda a, res: f"{a['path']} contains {', '.join(res['files'])}."),
    _fn("file_size", "The size of a file in bytes", {"path": _prop("string", "the file's path")},
        ["How big is {path}?", "What is the size of {path}?", "How many bytes is {path}?"],
        lambda r: {"path": _path(r)}, lambda a: {"path": a["path"], "bytes": sum(map(ord, a["path"])) * 7},
        lambda a, res: f"{a['path']} is {res['bytes']} bytes."),
    _fn("find_files", "Find files whose names match a pattern",
        {"pattern": _prop("string", "a glob pattern like *.py"), "directory": _prop("string", "where to look")},
        ["Find {pattern} files in {directory}.", "Search {directory} for {pattern}.",
         "Are there any {pattern} files under {directory}?"],
        lambda r: {"pattern": "*." + r.choice(["py", "txt", "md", "csv", "json", "log", "ini"]), "directory": r.choice(DIRS)},
        lambda a: {"matches": [f"{a['directory']}/{f}" for f in _listing(a["directory"])
                               if f.endswith(a["pattern"][1:])]},
        lambda a, res: (f"I found {', '.join(res['matches'])}." if res["matches"]
                        else f"There are no {a['pattern']} files in {a['directory']}.")),
    _fn("translate", "Translate a short phrase",
        {"text": _prop("string", "the phrase"), "language": _prop("string", "the language to translate into")},
        ["How do you say \"{text}\" in {language}?", "Translate \"{text}\" into {language}.",
         "What is \"{text}\" in {language}?"],
        lambda r: {"text": r.choice(list(LANGUAGES["French"])), "language": r.choice(list(LANGUAGES))},
        lambda a: {"translation": LANGUAGES[a["language"]][a["text"]]},
        lambda a, res: f"In {a['language']}, \"{a['text']}\" is \"{res['translation']}\"."),
    _fn("define_word", "The dictionary definition of a word", {"word": _prop("string", "the word")},
        ["What does the word {word} mean?", "Define {word}.", "Give me the definition of {word}."],
        lambda r: {"word": r.choice(WORDS)}, lambda a: {"word": a["word"], "definition": DEFINITIONS[a["word"]]},
        lambda a, res: f"{a['word'].capitalize()} means {res['definition']}."),
    _fn("count_words", "Count the words in a text", {"text": _prop("string", "the text")},
        ["How many words are in \"{text}\"?", "Count the words in \"{text}\".", "Word count of \"{text}\"?"],
        lambda r: {"text": _text(r)}, lambda a: {"count": len(a["text"].split())},
        lambda a, res: f"\"{a['text']}\" has {res['count']} words."),
    _fn("reverse_text", "Reverse a piece of text", {"text": _prop("string", "the text")},
        ["Reverse the text \"{text}\".", "What is \"{text}\" backwards?", "Spell \"{text}\" in reverse."],
        lambda r: {"text": r.choice(WORDS)}, lambda a: {"result": a["text"][::-1]},
        lambda a, res: f"\"{a['text']}\" reversed is \"{res['result']}\"."),
    _fn("uppercase", "Convert text to upper case", {"text": _prop("string", "the text")},
        ["Make \"{text}\" upper case.", "Write \"{text}\" in capital letters.", "Uppercase \"{text}\"."],
        lambda r: {"text": _text(r)}, lambda a: {"result": a["text"].upper()},
        lambda a, res: f"In upper case: {res['result']}"),
    _fn("get_capital", "The capital city of a country", {"country": _prop("string", "the country")},
        ["What is the capital of {country}?", "Which city is the capital of {country}?", "Capital of {country}?"],
        lambda r: {"country": r.choice(list(COUNTRIES))}, lambda a: {"capital": COUNTRIES[a["country"]][0]},
        lambda a, res: f"The capital of {a['country']} is {res['capital']}."),
    _fn("get_population", "The population of a country, in millions", {"country": _prop("string", "the country")},
        ["How many people live in {country}?", "What is the population of {country}?", "Population of {country}?"],
        lambda r: {"country": r.choice(list(COUNTRIES))}, lambda a: {"millions": COUNTRIES[a["country"]][1]},
        lambda a, res: f"About {res['millions']} million people live in {a['country']}."),
    _fn("get_distance", "The distance between two cities in km",
        {"origin": _prop("string", "the first city"), "destination": _prop("string", "the second city")},
        ["How far is {origin} from {destination}?", "Distance from {origin} to {destination}?",
         "How many km between {origin} and {destination}?"],
        lambda r: dict(zip(("origin", "destination"), r.sample(CITIES, 2))),
        lambda a: {"km": (sum(map(ord, a["origin"])) * sum(map(ord, a["destination"]))) % 9000 + 200},
        lambda a, res: f"{a['origin']} is {res['km']} km from {a['destination']}."),
    _fn("lookup_user", "Look up a user account by name", {"username": _prop("string", "the user name")},
        ["Look up the user {username}.", "What is the email of user {username}?", "Find the account {username}."],
        lambda r: {"username": r.choice(NAMES)},
        lambda a: {"username": a["username"], "email": f"{a['username']}@example.com",
                   "active": len(a["username"]) % 2 == 1},
        lambda a, res: f"{a['username']} has the email {res['email']} and is "
                       f"{'active' if res['active'] else 'inactive'}."),
    _fn("send_email", "Send an email",
        {"to": _prop("string", "the address"), "subject": _prop("string", "the subject line")},
        ["Send an email to {to} with the subject \"{subject}\".", "Email {to}: subject \"{subject}\".",
         "Please mail {to} about \"{subject}\"."],
        lambda r: {"to": f"{r.choice(NAMES)}@example.com", "subject": r.choice(["Lunch", "Meeting notes", "Hello",
                                                                               "Invoice", "Weekend plans", "Report"])},
        lambda a: {"sent": True, "id": sum(map(ord, a["to"] + a["subject"]))},
        lambda a, res: f"Sent the email \"{a['subject']}\" to {a['to']}."),
    _fn("create_reminder", "Create a reminder at a time",
        {"text": _prop("string", "what to remind about"), "time": _prop("string", "when, like 18:30")},
        ["Remind me to {text} at {time}.", "Set a reminder at {time} to {text}.", "At {time}, remind me to {text}."],
        lambda r: {"text": r.choice(["call mom", "water the plants", "take the bus", "buy bread", "pay the rent",
                                     "feed the cat", "stretch"]), "time": f"{r.randint(6, 22):02d}:{r.choice([0, 15, 30, 45]):02d}"},
        lambda a: {"created": True},
        lambda a, res: f"Done: I will remind you to {a['text']} at {a['time']}."),
    _fn("calendar_events", "The calendar events on a date", {"date": _prop("string", "a date, YYYY-MM-DD")},
        ["What is on my calendar on {date}?", "Do I have meetings on {date}?", "Show my events for {date}."],
        lambda r: {"date": _date(r)},
        lambda a: {"events": [["standup at 09:00", "dentist at 15:00", "lunch with Bob", "review at 11:00"][
            int(a["date"][-2:]) % 4]] if int(a["date"][-2:]) % 3 else []},
        lambda a, res: (f"On {a['date']} you have: {', '.join(res['events'])}." if res["events"]
                        else f"You have nothing on {a['date']}.")),
    _fn("days_between", "The number of days between two dates",
        {"start": _prop("string", "the first date, YYYY-MM-DD"), "end": _prop("string", "the second date, YYYY-MM-DD")},
        ["How many days are there from {start} to {end}?", "Days between {start} and {end}?",
         "Count the days from {start} until {end}."],
        lambda r: dict(zip(("start", "end"), sorted([_date(r), _date(r)]))),
        lambda a: {"days": _days(a["start"], a["end"])},
        lambda a, res: f"There are {res['days']} days from {a['start']} to {a['end']}."),
    _fn("random_number", "A random integer in a range",
        {"low": _prop("integer", "the smallest value"), "high": _prop("integer", "the largest value")},
        ["Pick a random number between {low} and {high}.", "Give me a random integer from {low} to {high}.",
         "Roll a number between {low} and {high}."],
        lambda r: dict(zip(("low", "high"), sorted(r.sample(range(1, 1000), 2)))),
        lambda a: {"value": (a["low"] * 31 + a["high"] * 17) % (a["high"] - a["low"] + 1) + a["low"]},
        lambda a, res: f"Your random number is {res['value']}."),
    _fn("search_web", "Search the web and return the top result", {"query": _prop("string", "the search terms")},
        ["Search the web for {query}.", "Look up {query} online.", "Find {query} on the web."],
        lambda r: {"query": r.choice(["python tutorials", "cheap flights", "banana bread recipe", "local news",
                                      "football scores", "how to tie a tie", "best hiking trails"])},
        lambda a: {"title": a["query"].title() + " - Example", "url": "https://example.com/" + a["query"].replace(" ", "-")},
        lambda a, res: f"The top result for {a['query']} is \"{res['title']}\" at {res['url']}."),
]

PLAIN = [  # (user message, answer) where no tool is needed
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Thank you!", "You're welcome!"),
    ("Thanks, that is all.", "Glad I could help. Goodbye!"),
    ("Who are you?", "I am a small assistant. I can answer questions and call the tools I am given."),
    ("What does `os.path.join` do?", "Join two or more path components, inserting the separator as needed."),
    ("What does `len` do?", "Return the number of items in a container."),
    ("What does `json.dumps` do?", "Serialize an object to a JSON formatted string."),
    ("What is a Python list?", "A list is a mutable sequence of items, written in square brackets."),
    ("Explain `str.upper`.", "Return a copy of the string converted to uppercase."),
    ("Tell me a joke.", "Why did the programmer quit? Because he did not get arrays."),
    ("Good morning.", "Good morning! How can I help?"),
]


def _render(messages: list[dict], tools: list[dict], add_generation_prompt: bool) -> str:
    from strata.server.tools import parse_tools, render_messages
    rendered, extra = render_messages(messages, parse_tools({"tools": tools, "tool_choice": "auto"}), _template()[0])
    return _template()[1].apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra)


_TEMPLATE = []


def _template():
    """(template source, a strata Tokenizer) of the demo pack: the server's own renderer."""
    if not _TEMPLATE:
        from strata.tokenizer import Tokenizer
        meta = json.loads((DEMO / "pack.json").read_text())["tokenizer"]
        tok = Tokenizer(DEMO / "tokenizer.json", meta)
        _TEMPLATE.extend([tok.chat_template, tok])
    return _TEMPLATE


def one_chat(r: random.Random, plain: bool = False) -> dict:
    """A seeded chat: offered tools (the needed one among 0-3 others), the conversation and its texts."""
    k = r.randint(1, 4)
    fns = r.sample(FUNCTIONS, k)
    tools = [f["def"] for f in fns]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if r.random() < 0.3 else []
    if plain:
        kind = r.random()
        if kind < 0.25:
            names = [t["function"]["name"] for t in tools]
            user, answer = (r.choice(["Which tools do you have?", "What functions can you call?"]),
                            "I can call " + ", ".join(names) + ".")
        else:
            user, answer = r.choice(PLAIN)
        messages += [{"role": "user", "content": user}]
        prompt = _render(messages, tools, True)
        messages.append({"role": "assistant", "content": answer})
        return {"tools": tools, "messages": messages, "prompt": prompt, "call": None,
                "text": _render(messages, tools, False)}
    f = fns[0]
    r.shuffle(tools)
    args = f["args"](r)
    user = r.choice(f["asks"]).format(**args)
    name = f["def"]["function"]["name"]
    messages.append({"role": "user", "content": user})
    prompt = _render(messages, tools, True)
    result = f["result"](args)
    messages += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result, ensure_ascii=False)},
                 {"role": "assistant", "content": f["answer"](args, result)}]
    return {"tools": tools, "messages": messages, "prompt": prompt, "call": {"name": name, "arguments": args},
            "text": _render(messages, tools, False)}


def chats(n: int, seed: int = SEED, plain_share: float = 0.15) -> list[dict]:
    r = random.Random(seed)
    return [one_chat(r, plain=r.random() < plain_share) for _ in range(n)]


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns' contents, each with its closing <|im_end|>."""
    spans, head, end = [], "<|im_start|>assistant\n", "<|im_end|>"
    at = text.find(head)
    while at >= 0:
        a = at + len(head)
        b = text.find(end, a)
        b = len(text) if b < 0 else b + len(end)
        spans.append((a, b))
        at = text.find(head, b)
    return spans


def encode(chat_list: list[dict], tokenizer_path: Path = DEMO / "tokenizer.json"):
    """Token ids of each chat's text and a 0/1 mask marking the assistant's tokens (its loss)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_path))
    out = []
    for c in chat_list:
        enc = tok.encode(c["text"], add_special_tokens=False)
        spans = assistant_spans(c["text"])
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc.offsets]
        out.append((enc.ids, mask))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--n", type=int, default=480)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--show", action="store_true")
    args = ap.parse_args(argv)
    cs = chats(args.n, args.seed)
    if args.show:
        for c in cs:
            print(c["text"], "-" * 60, sep="\n")
    enc = encode(cs)
    lens = [len(ids) for ids, _ in enc]
    print(json.dumps({"chats": len(cs), "with_call": sum(c["call"] is not None for c in cs),
                      "tokens": sum(lens), "max_tokens": max(lens), "mean_tokens": round(sum(lens) / len(lens), 1),
                      "functions": len(FUNCTIONS)}), file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tool_chats.json").write_text(json.dumps(
            [{"text": c["text"], "ids": ids, "mask": m} for c, (ids, m) in zip(cs, enc)]) + "\n")


if __name__ == "__main__":
    main()
