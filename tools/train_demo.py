"""Train the bundled demo model: a tiny qwen4_exp ("Qwen3.8-Flash-Next") that really writes code-like Python.

    python -m tools.train_demo --out strata_jax/demo [--steps N] [--minutes M] [--seed 0]

Everything is deterministic for a given `--seed` and `--steps` (a `--minutes` cap stops early and says so):

* corpus: the Python source of this interpreter's standard library (sorted file list; tests, encodings and huge
  data files left out; every HOLDOUT_EVERY-th file held out for evaluation) mixed with a few hundred synthetic chat
  conversations rendered through the chat template: instructions answered with code (with and without `<think>`),
  explanations, and tool calls in the template's XML format with the tools in the system turn;
* tokenizer: byte-level BPE trained with `tokenizers` (Qwen2 pre-tokenizer, specials at the end of the vocab),
  tokenizer_config.json with the Qwen3-Coder-style chat template and eos `<|im_end|>`;
* model: our own `CausalLM` at a small qwen4_exp shape with every building block (Gated DeltaNet, QSA indexed
  attention, MoE + shared expert, 4 hyper-connection streams, one PLE layer, one MTP layer), trained with optax
  AdamW (warmup + cosine) in float32 on the CPU. Losses: next token, MTP (token t+2 from the main model's final
  hidden state at t and the embedding of token t+1), a router load-balancing term, and a QSA indexer term (KL from
  the attention's own block mass to the indexer's block scores, on a detached input, as DeepSeek-V3.2 trains its
  indexer). The PLE table is a trainable array here; rows are gathered with the host hash (`NgramHasher.row_ids`);
* export: Hugging Face layout (config.json, model.safetensors in bf16 with our parameter paths as names, experts
  fused, the PLE table under its HF name, `mtp.*`), tokenizer files, generation_config.json; then the exported
  checkpoint is evaluated through `strata_jax.load_model` (bf16, and with experts quantized to 1/2/3 bit-planes)
  and the results are written to `<out>/README.md`.

optax is only needed here: `pip install -e '.[train]'`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from tools.chat_template import QWEN3_CODER_TEMPLATE, SPECIAL_TOKENS, tokenizer_config

VOCAB_SIZE = 3072  # including the special tokens (at the end)
# Copied from transformers' Qwen2Tokenizer so both libraries tokenize identically.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
HOLDOUT_EVERY = 25  # every 25th stdlib file (sorted order) is held out
MAX_FILE_BYTES = 250_000
EXCLUDED_DIRS = {"test", "tests", "idle_test", "encodings", "pydoc_data", "site-packages", "__pycache__"}
TOKENIZER_TRAIN_EVERY = 3  # the BPE is trained on every 3rd training file (plus all chat text)
N_CHAT = 900  # synthetic conversations; every 10th is held out
CHAT_FRACTION = 0.25  # share of training rows that start at a chat conversation
SNIPPET_FRACTION = 0.08  # share of training rows that start at a synthetic snippet (a task's code as a plain file)

# Qwen3-Coder-style chat template (the same as tests/fixtures/make_tokenizer_fixture.py).
CHAT_TEMPLATE = QWEN3_CODER_TEMPLATE

# ----------------------------------------------------------------------------------------------------------------------
# Model shape
# ----------------------------------------------------------------------------------------------------------------------


def hf_config(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """config.json of the demo model (qwen4_exp text model, every building block present, all tiny)."""
    return {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": "qwen4_exp_text",
        "dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
        },
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": True,
        "hc_count": 4,
        "hc_lowrank": 32,
        "ple_layer_ids": [2],  # one-indexed: model.layers.1
        "ple_embed_dim": 64,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 8000,
        "make_ngram_vocab_size_divisible_by": 64,
        "split_ngram_parts": 1,
        "seed": 1234,
        "ple_conv_kernel_size": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 128,
        "indexer_compress_ratio": 4,
        "output_gate_type": "sigmoid",
        "hidden_act": "silu",
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_mtp_layers": 1,
        "mtp_layer_types": ["indexed_attention"],
    }


# ----------------------------------------------------------------------------------------------------------------------
# Corpus: the standard library
# ----------------------------------------------------------------------------------------------------------------------


def stdlib_files() -> tuple[Path, list[str], list[str]]:
    """(stdlib root, training files, held-out files): relative paths, sorted, deterministic split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = []
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).parts
        if any(p in EXCLUDED_DIRS for p in parts[:-1]) or f.stat().st_size > MAX_FILE_BYTES:
            continue
        rel.append("/".join(parts))
    rel.sort()
    train = [r for i, r in enumerate(rel) if i % HOLDOUT_EVERY]
    held = [r for i, r in enumerate(rel) if i % HOLDOUT_EVERY == 0]
    return root, train, held


def read_sources(root: Path, names: list[str]) -> list[str]:
    out = []
    for name in names:
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(text)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Synthetic chat data
# ----------------------------------------------------------------------------------------------------------------------

# (description, function name, code). Descriptions complete "a function that ..." / "... it should ...".
TASKS: list[tuple[str, str, str]] = [
    ("returns the sum of a list of numbers", "sum_list",
     "def sum_list(numbers):\n    total = 0\n    for x in numbers:\n        total += x\n    return total\n"),
    ("reverses a string", "reverse_string", "def reverse_string(s):\n    return s[::-1]\n"),
    ("computes the factorial of n", "factorial",
     "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n"),
    ("returns the n-th Fibonacci number", "fibonacci",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
    ("checks whether a number is prime", "is_prime",
     ("def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True\n")),
    ("returns the largest element of a list", "find_max",
     ("def find_max(values):\n    if not values:\n        raise ValueError(\"empty list\")\n    best = values[0]\n"
     "    for v in values[1:]:\n        if v > best:\n            best = v\n    return best\n")),
    ("counts the vowels in a string", "count_vowels",
     "def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in \"aeiou\")\n"),
    ("checks whether a string is a palindrome", "is_palindrome",
     ("def is_palindrome(s):\n    cleaned = \"\".join(ch.lower() for ch in s if ch.isalnum())\n"
     "    return cleaned == cleaned[::-1]\n")),
    ("flattens a list of lists", "flatten",
     "def flatten(lists):\n    result = []\n    for sub in lists:\n        result.extend(sub)\n    return result\n"),
    ("removes duplicates from a list while keeping the order", "unique",
     ("def unique(items):\n    seen = set()\n    result = []\n    for item in items:\n        if item not in seen:\n"
     "            seen.add(item)\n            result.append(item)\n    return result\n")),
    ("counts how often each word appears in a text", "word_count",
     ("def word_count(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
     "    return counts\n")),
    ("converts a temperature from Celsius to Fahrenheit", "celsius_to_fahrenheit",
     "def celsius_to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32\n"),
    ("returns the average of a list of numbers", "average",
     "def average(numbers):\n    if not numbers:\n        return 0.0\n    return sum(numbers) / len(numbers)\n"),
    ("computes the greatest common divisor of two integers", "gcd",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n"),
    ("finds an item in a sorted list with binary search", "binary_search",
     ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
     "        if items[mid] == target:\n            return mid\n        if items[mid] < target:\n            lo = mid + 1\n"
     "        else:\n            hi = mid - 1\n    return -1\n")),
    ("sorts a list with insertion sort", "insertion_sort",
     ("def insertion_sort(items):\n    items = list(items)\n    for i in range(1, len(items)):\n        key = items[i]\n"
     "        j = i - 1\n        while j >= 0 and items[j] > key:\n            items[j + 1] = items[j]\n            j -= 1\n"
     "        items[j + 1] = key\n    return items\n")),
    ("merges two sorted lists into one sorted list", "merge_sorted",
     ("def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
     "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
     "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
     "    return result\n")),
    ("splits a list into chunks of size n", "chunks",
     "def chunks(items, n):\n    return [items[i:i + n] for i in range(0, len(items), n)]\n"),
    ("reads a text file and returns its lines", "read_lines",
     "def read_lines(path):\n    with open(path, encoding=\"utf-8\") as f:\n        return f.read().splitlines()\n"),
    ("capitalizes every word in a sentence", "title_case",
     "def title_case(sentence):\n    return \" \".join(word.capitalize() for word in sentence.split())\n"),
    ("returns the second largest number in a list", "second_largest",
     ("def second_largest(numbers):\n    unique = sorted(set(numbers))\n    if len(unique) < 2:\n        return None\n"
     "    return unique[-2]\n")),
    ("returns the squares of a list of numbers", "squares",
     "def squares(numbers):\n    return [x * x for x in numbers]\n"),
    ("keeps only the even numbers of a list", "even_numbers",
     "def even_numbers(numbers):\n    return [x for x in numbers if x % 2 == 0]\n"),
    ("swaps the keys and values of a dictionary", "invert_dict",
     "def invert_dict(d):\n    return {value: key for key, value in d.items()}\n"),
    ("converts a string to an int and returns a default when that fails", "safe_int",
     ("def safe_int(text, default=0):\n    try:\n        return int(text)\n    except (TypeError, ValueError):\n"
     "        return default\n")),
    ("clamps a value between a lower and an upper bound", "clamp",
     "def clamp(value, low, high):\n    return max(low, min(value, high))\n"),
    ("transposes a matrix given as a list of rows", "transpose",
     "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]\n"),
    ("returns the running totals of a list", "running_total",
     ("def running_total(numbers):\n    result = []\n    total = 0\n    for x in numbers:\n        total += x\n"
     "        result.append(total)\n    return result\n")),
    ("checks whether two words are anagrams", "is_anagram",
     "def is_anagram(a, b):\n    return sorted(a.lower()) == sorted(b.lower())\n"),
    ("prints the FizzBuzz sequence up to n", "fizzbuzz",
     ("def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print(\"FizzBuzz\")\n"
     "        elif i % 3 == 0:\n            print(\"Fizz\")\n        elif i % 5 == 0:\n            print(\"Buzz\")\n"
     "        else:\n            print(i)\n")),
    ("checks whether a year is a leap year", "is_leap_year",
     "def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n"),
    ("counts the lines of a file", "count_lines",
     "def count_lines(path):\n    with open(path, encoding=\"utf-8\") as f:\n        return sum(1 for _ in f)\n"),
    ("loads a JSON file and returns the data", "load_json",
     "import json\n\n\ndef load_json(path):\n    with open(path, encoding=\"utf-8\") as f:\n        return json.load(f)\n"),
    ("yields the squares of the numbers below n", "square_numbers",
     "def square_numbers(n):\n    for i in range(n):\n        yield i * i\n"),
    ("returns the n-th Fibonacci number using memoization", "fib",
     ("from functools import lru_cache\n\n\n@lru_cache(maxsize=None)\ndef fib(n):\n    if n < 2:\n        return n\n"
     "    return fib(n - 1) + fib(n - 2)\n")),
    ("parses a string like \"a=1,b=2\" into a dictionary", "parse_pairs",
     ("def parse_pairs(text):\n    result = {}\n    for part in text.split(\",\"):\n        if \"=\" in part:\n"
     "            key, value = part.split(\"=\", 1)\n            result[key.strip()] = value.strip()\n    return result\n")),
    ("returns the k most common words of a text", "top_words",
     "from collections import Counter\n\n\ndef top_words(text, k=3):\n    return [w for w, _ in Counter(text.split()).most_common(k)]\n"),
    ("returns the extension of a file name", "file_extension",
     "import os\n\n\ndef file_extension(name):\n    return os.path.splitext(name)[1]\n"),
    ("reverses the order of the words in a sentence", "reverse_words",
     "def reverse_words(sentence):\n    return \" \".join(reversed(sentence.split()))\n"),
    ("returns the smallest and the largest value of a list", "min_max",
     "def min_max(values):\n    return min(values), max(values)\n"),
    ("adds up the digits of a number", "digit_sum",
     "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n"),
    ("counts how many times a character occurs in a string", "count_char",
     ("def count_char(text, ch):\n    count = 0\n    for c in text:\n        if c == ch:\n            count += 1\n"
     "    return count\n")),
    ("returns the last n elements of a list", "last_n", "def last_n(items, n):\n    return items[-n:] if n > 0 else []\n"),
    ("checks whether a list is sorted", "is_sorted",
     "def is_sorted(items):\n    return all(items[i] <= items[i + 1] for i in range(len(items) - 1))\n"),
    ("returns the length of the longest word in a sentence", "longest_word_length",
     "def longest_word_length(sentence):\n    return max((len(w) for w in sentence.split()), default=0)\n"),
    ("groups words by their first letter", "group_by_first_letter",
     ("from collections import defaultdict\n\n\ndef group_by_first_letter(words):\n    groups = defaultdict(list)\n"
     "    for word in words:\n        if word:\n            groups[word[0]].append(word)\n    return dict(groups)\n")),
    ("computes the power of a number by repeated multiplication", "power",
     "def power(base, exponent):\n    result = 1\n    for _ in range(exponent):\n        result *= base\n    return result\n"),
    ("converts a list of strings to upper case", "to_upper",
     "def to_upper(words):\n    return [w.upper() for w in words]\n"),
    ("returns the index of the first negative number, or -1", "first_negative",
     ("def first_negative(numbers):\n    for i, x in enumerate(numbers):\n        if x < 0:\n            return i\n"
     "    return -1\n")),
    ("zips two lists into a dictionary", "make_dict",
     "def make_dict(keys, values):\n    return dict(zip(keys, values))\n"),
]

# Small classes, asked for as "a class ...".
CLASS_TASKS: list[tuple[str, str, str]] = [
    ("a stack with push, pop and peek", "Stack",
     ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
     "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n"
     "        return self.items[-1]\n\n    def is_empty(self):\n        return not self.items\n")),
    ("a 2D point with a method that returns the distance to another point", "Point",
     ("import math\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n    x: float\n    y: float\n\n"
     "    def distance(self, other):\n        return math.hypot(self.x - other.x, self.y - other.y)\n")),
    ("a counter that can be incremented and reset", "Counter",
     ("class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def increment(self, step=1):\n"
     "        self.value += step\n        return self.value\n\n    def reset(self):\n        self.value = 0\n")),
    ("a queue based on collections.deque", "Queue",
     ("from collections import deque\n\n\nclass Queue:\n    def __init__(self):\n        self._items = deque()\n\n"
     "    def enqueue(self, item):\n        self._items.append(item)\n\n    def dequeue(self):\n"
     "        return self._items.popleft()\n\n    def __len__(self):\n        return len(self._items)\n")),
    ("a bank account with deposit and withdraw methods", "BankAccount",
     ("class BankAccount:\n    def __init__(self, balance=0):\n        self.balance = balance\n\n    def deposit(self, amount):\n"
     "        if amount <= 0:\n            raise ValueError(\"amount must be positive\")\n        self.balance += amount\n\n"
     "    def withdraw(self, amount):\n        if amount > self.balance:\n            raise ValueError(\"insufficient funds\")\n"
     "        self.balance -= amount\n")),
    ("a rectangle with area and perimeter methods", "Rectangle",
     ("class Rectangle:\n    def __init__(self, width, height):\n        self.width = width\n        self.height = height\n\n"
     "    def area(self):\n        return self.width * self.height\n\n    def perimeter(self):\n"
     "        return 2 * (self.width + self.height)\n")),
]

FUNCTION_ASKS = [
    "Write a Python function that {d}.",
    "Write a function that {d}.",
    "Write a Python function `{n}` that {d}.",
    "Can you write a Python function that {d}?",
    "Implement `{n}` in Python. It {d}.",
    "I need a function that {d}.",
    "Please write Python code for a function that {d}.",
    "Create a function named {n} that {d}.",
    "How do I write a function in Python that {d}?",
    "write a python function that {d}",
]
CLASS_ASKS = [
    "Write a Python class for {d}.",
    "Implement {d} in Python.",
    "Can you write a class `{n}`: {d}?",
    "Create a Python class {n} - {d}.",
]
INTROS = [
    "Here is a function that {d}:",
    "Here's a simple implementation:",
    "Sure! Here is `{n}`:",
    "You can do it like this:",
    "",
]
OUTROS = [
    "",
    "",
    "The function `{n}` {d}.",
    "It runs in a single pass over the input.",
    "You can call it as `{n}(...)` with your own data.",
]
THOUGHTS = [
    "The user wants a function that {d}. I will call it `{n}` and keep it short.",
    "I need to write `{n}`. It {d}. A simple loop or a built-in is enough.",
    "A function that {d}. Let me write it in plain Python with a clear name.",
]
SYSTEMS = [
    None,
    None,
    "You are a helpful assistant.",
    "You are a helpful coding assistant.",
    "You are Qwen, a coding assistant. Answer with Python code.",
]

TOOLS = {
    "read_file": {
        "description": "Read the contents of a file.",
        "properties": {"path": {"type": "string", "description": "Path of the file to read."}},
        "required": ["path"],
    },
    "write_file": {
        "description": "Write text to a file, replacing its contents.",
        "properties": {
            "path": {"type": "string", "description": "Path of the file."},
            "content": {"type": "string", "description": "The new contents."},
        },
        "required": ["path", "content"],
    },
    "run_command": {
        "description": "Run a shell command and return its output.",
        "properties": {"command": {"type": "string", "description": "The command line."}},
        "required": ["command"],
    },
    "search_code": {
        "description": "Search the repository for a pattern.",
        "properties": {"pattern": {"type": "string", "description": "Text to look for."}},
        "required": ["pattern"],
    },
    "list_files": {
        "description": "List the files in a directory.",
        "properties": {"directory": {"type": "string", "description": "The directory."}},
        "required": ["directory"],
    },
    "run_python": {
        "description": "Run a Python snippet and return what it prints.",
        "properties": {"code": {"type": "string", "description": "Python source code."}},
        "required": ["code"],
    },
    "get_weather": {
        "description": "Get the current weather in a city.",
        "properties": {
            "city": {"type": "string", "description": "City name."},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}

DIRS = ["src", "app", "lib", "utils", "core", "tools", "scripts", "pkg"]
MODULES = ["utils", "helpers", "main", "config", "parser", "models", "server", "client", "cli", "math_utils"]
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto"]
PY_SNIPPETS = [
    ("What is 2 to the power of 10?", "print(2 ** 10)", "1024"),
    ("Compute the sum of the squares from 1 to 10.", "print(sum(i * i for i in range(1, 11)))", "385"),
    ("How many days are in 3 weeks?", "print(3 * 7)", "21"),
    ("What is the length of the string 'hello world'?", "print(len('hello world'))", "11"),
    ("Sort the list [3, 1, 2] for me.", "print(sorted([3, 1, 2]))", "[1, 2, 3]"),
    ("What is 17 * 23?", "print(17 * 23)", "391"),
    ("Reverse the string 'python'.", "print('python'[::-1])", "nohtyp"),
    ("What is the factorial of 6?", "import math\nprint(math.factorial(6))", "720"),
]


def _tool_schema(name: str) -> dict:
    spec = TOOLS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": spec["description"],
            "parameters": {"type": "object", "properties": spec["properties"], "required": spec["required"]},
        },
    }


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _code_answer(rng, desc: str, name: str, code: str) -> str:
    if rng.random() < 0.3 and code.startswith("def "):
        head, body = code.split("\n", 1)
        code = f'{head}\n    """{desc[0].upper()}{desc[1:]}."""\n{body}'
    intro = _pick(rng, INTROS).format(d=desc, n=name)
    outro = _pick(rng, OUTROS).format(d=desc, n=name)
    text = (intro + "\n\n" if intro else "") + "```python\n" + code + "```"
    return text + ("\n\n" + outro if outro else "")


def _with_thinking(rng, msg: dict, thought: str) -> tuple[dict, str]:
    """Either a reasoning trace (rendered as <think> by the template), an empty think block (the prompt of
    enable_thinking=False), or nothing. Returns the message and the mode."""
    r = rng.random()
    if r < 0.35:
        return {**msg, "reasoning_content": thought}, "think"
    if r < 0.6:
        return msg, "empty_think"
    return msg, "plain"


def _code_conversation(rng) -> tuple[list[dict], None, str]:
    if rng.random() < 0.85:
        desc, name, code = _pick(rng, TASKS)
        ask = _pick(rng, FUNCTION_ASKS).format(d=desc, n=name)
    else:
        desc, name, code = _pick(rng, CLASS_TASKS)
        ask = _pick(rng, CLASS_ASKS).format(d=desc, n=name)
    messages = []
    system = _pick(rng, SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": ask})
    answer, mode = _with_thinking(rng, {"role": "assistant", "content": _code_answer(rng, desc, name, code)},
                                  _pick(rng, THOUGHTS).format(d=desc, n=name))
    messages.append(answer)
    return messages, None, mode


def _explain_conversation(rng) -> tuple[list[dict], None, str]:
    desc, name, code = _pick(rng, TASKS)
    ask = _pick(rng, ["What does this function do?", "Explain this code:", "What does `{n}` do?"]).format(n=name)
    answer = _pick(rng, ["It {d}.", "`{n}` {d}.", "This function {d}."]).format(d=desc, n=name)
    messages = [
        {"role": "user", "content": f"{ask}\n\n```python\n{code}```"},
        {"role": "assistant", "content": answer},
    ]
    return messages, None, "plain"


def _tool_conversation(rng) -> tuple[list[dict], list[dict], str]:
    kind = int(rng.integers(7))
    folder = _pick(rng, DIRS)
    module = _pick(rng, MODULES)
    path = f"{folder}/{module}.py"
    desc, name, code = _pick(rng, TASKS)
    if kind == 0:
        tool, user = "read_file", _pick(rng, ["Show me {p}.", "What is in {p}?", "Open {p}.", "Read {p} please."])
        call = _call(tool, path=path)
        result = code
        final = f"`{path}` defines `{name}`, a function that {desc}."
        thought = f"I should read {path} first."
    elif kind == 1:
        tool = "run_command"
        test = f"tests/test_{module}.py"
        user = _pick(rng, ["Run the tests in {t}.", "Can you run {t}?", "Check that {t} passes."]).replace("{t}", test)
        call = _call(tool, command=f"python -m pytest {test} -q")
        n = int(rng.integers(1, 12))
        if rng.random() < 0.7:
            result, final = f"{n} passed in 0.{int(rng.integers(10, 99))}s", f"All {n} tests in `{test}` passed."
        else:
            result = f"1 failed, {n} passed in 0.{int(rng.integers(10, 99))}s"
            final = f"One test in `{test}` failed and {n} passed."
        thought = "I will run pytest on that file."
    elif kind == 2:
        tool = "write_file"
        user = f"Create {path} with a function that {desc}."
        call = _call(tool, path=path, content=code)
        result = f"Wrote {len(code)} bytes to {path}"
        final = f"I created `{path}` with the function `{name}`."
        thought = f"I will write `{name}` to {path}."
    elif kind == 3:
        tool = "search_code"
        user = _pick(rng, ["Where is `{n}` defined?", "Find the definition of {n}.", "Which file defines {n}?"])
        call = _call(tool, pattern=f"def {name}")
        line = int(rng.integers(1, 300))
        result = f"{path}:{line}: def {name}("
        final = f"`{name}` is defined in `{path}` at line {line}."
        thought = f"I will search for the definition of {name}."
    elif kind == 4:
        tool = "list_files"
        user = _pick(rng, ["What files are in {f}?", "List the files in {f}.", "Show me the contents of the {f} folder."])
        call = _call(tool, directory=folder)
        files = sorted({f"{m}.py" for m in rng.choice(MODULES, size=3, replace=False)})
        result = "\n".join(files)
        final = f"The `{folder}` directory contains " + ", ".join(f"`{f}`" for f in files) + "."
        thought = f"I will list the directory {folder}."
    elif kind == 5:
        tool = "run_python"
        question, snippet, output = _pick(rng, PY_SNIPPETS)
        user = question
        call = _call(tool, code=snippet)
        result = output
        final = f"The result is {output}."
        thought = "I can compute this with a short Python snippet."
    else:
        tool = "get_weather"
        city = _pick(rng, CITIES)
        user = _pick(rng, ["What's the weather in {c}?", "Is it cold in {c} today?", "Weather for {c}, please."])
        user = user.replace("{c}", city)
        args = {"city": city}
        if rng.random() < 0.4:
            args["unit"] = _pick(rng, ["celsius", "fahrenheit"])
        call = _call(tool, **args)
        temp = int(rng.integers(-5, 32))
        result = json.dumps({"city": city, "temperature": temp, "condition": _pick(rng, ["sunny", "cloudy", "rain"])})
        final = f"It is {temp} degrees in {city} right now."
        thought = f"I should call get_weather for {city}."
    user = user.replace("{p}", path).replace("{n}", name).replace("{f}", folder)
    others = [t for t in TOOLS if t != tool]
    chosen = [tool] + list(rng.choice(others, size=int(rng.integers(0, 3)), replace=False))
    rng.shuffle(chosen)
    tools = [_tool_schema(t) for t in chosen]
    messages = []
    system = _pick(rng, SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    preface = _pick(rng, ["", "", "", "Let me check.", "I'll use the {t} tool."]).replace("{t}", tool)
    call_msg, mode = _with_thinking(rng, {"role": "assistant", "content": preface, "tool_calls": [call]}, thought)
    messages.append(call_msg)
    if rng.random() < 0.75:  # sometimes the conversation ends at the call (what a server sees most)
        messages.append({"role": "tool", "content": result})
        messages.append({"role": "assistant", "content": final})
        mode = "plain" if mode == "empty_think" else mode
    return messages, tools, mode


def chat_conversations(seed: int, n: int) -> list[tuple[list[dict], list[dict] | None, str]]:
    """`n` deterministic conversations: (messages, tools or None, thinking mode)."""
    rng = np.random.default_rng(seed + 1000)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            out.append(_code_conversation(rng))
        elif r < 0.65:
            out.append(_explain_conversation(rng))
        else:
            out.append(_tool_conversation(rng))
    return out


def code_snippets(seed: int) -> list[str]:
    """Every task's code as a small file of its own (as is, with a docstring, with a usage line), shuffled."""
    rng = np.random.default_rng(seed + 2000)
    out = []
    for desc, name, code in TASKS + CLASS_TASKS:
        out.append(code)
        if code.startswith("def "):
            head, body = code.split("\n", 1)
            out.append(f'{head}\n    """{desc[0].upper()}{desc[1:]}."""\n{body}')
        out.append(f"# {name}: {desc}\n\n{code}")
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def render_conversation(tokenizer, messages: list[dict], tools: list[dict] | None, mode: str) -> str:
    """The training text of one conversation, exactly as the template renders it at inference."""
    if mode == "empty_think":  # the prompt with enable_thinking=False, then the final answer
        last = messages[-1]
        prompt = tokenizer.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True,
                                               enable_thinking=False)
        body = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, last], add_generation_prompt=False)
        answer = body.split("<|im_start|>assistant\n", 1)[1]
        return prompt + answer
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------------


def _new_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _add_specials(tok) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])


def write_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n",
                                        encoding="utf-8")
    config = tokenizer_config(tok.token_to_id, 4096)
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                               encoding="utf-8")


def template_renderer(tmp: Path):
    """A `strata_jax.tokenizer.Tokenizer` with the chat template and an untrained vocab: rendering only needs the
    template, and the BPE is trained on rendered conversations afterwards."""
    from strata_jax.tokenizer import load_tokenizer

    tok = _new_bpe()
    _add_specials(tok)
    write_tokenizer(tok, tmp)
    return load_tokenizer(tmp)


def train_tokenizer(code_texts: list[str], chat_texts: list[str]):
    from tokenizers import pre_tokenizers, trainers

    tok = _new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # Specials are stripped from chat text for BPE training (they become single tokens anyway).
    chat = []
    for text in chat_texts:
        for s in SPECIAL_TOKENS:
            text = text.replace(s, "\n")
        chat.append(text)
    tok.train_from_iterator(code_texts + chat, trainer=trainer)
    _add_specials(tok)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tok.get_vocab_size(with_added_tokens=True)
    return tok


# ----------------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------------


class Corpus:
    """Token streams (documents joined by <|endoftext|>) and the sampler of training windows."""

    def __init__(self, tok, code_texts: list[str], chat_texts: list[str], held_code: list[str], held_chat: list[str],
                 snippets: list[str]):
        eot = tok.token_to_id("<|endoftext|>")

        def stream(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            encs = tok.encode_batch(texts, add_special_tokens=False)
            starts, parts, pos = [], [], 0
            for e in encs:
                ids = e.ids + [eot]
                starts.append(pos)
                parts.append(np.asarray(ids, np.int32))
                pos += len(ids)
            return np.concatenate(parts), np.asarray(starts, np.int64)

        self.code, _ = stream(code_texts)
        self.chat, self.chat_starts = stream(chat_texts)
        self.held_code, _ = stream(held_code)
        self.held_chat, self.held_chat_starts = stream(held_chat)
        self.chat_lengths = np.diff(np.append(self.chat_starts, len(self.chat)))
        self.snippets, self.snippet_starts = stream(snippets)

    @staticmethod
    def _window(stream: np.ndarray, start: int, n: int) -> np.ndarray:
        if start + n <= len(stream):
            return stream[start:start + n]
        return np.concatenate([stream[start:], stream[: start + n - len(stream)]])

    def batch(self, rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
        """[batch, n] windows: CHAT_FRACTION start at a conversation, SNIPPET_FRACTION at a snippet (both packed
        with the documents that follow), the rest anywhere in the code stream."""
        rows = []
        for _ in range(batch):
            r = rng.random()
            if r < CHAT_FRACTION:
                start = int(self.chat_starts[rng.integers(len(self.chat_starts))])
                rows.append(self._window(self.chat, start, n))
            elif r < CHAT_FRACTION + SNIPPET_FRACTION:
                start = int(self.snippet_starts[rng.integers(len(self.snippet_starts))])
                rows.append(self._window(self.snippets, start, n))
            else:
                rows.append(self._window(self.code, int(rng.integers(len(self.code))), n))
        return np.stack(rows)

    def eval_windows(self, kind: str, count: int, n: int) -> np.ndarray:
        """Fixed held-out windows: evenly spaced in the held-out code, or starting at held-out conversations."""
        if kind == "code":
            stride = max((len(self.held_code) - n) // count, 1)
            return np.stack([self.held_code[i * stride:i * stride + n] for i in range(count)])
        starts = self.held_chat_starts[:count]
        return np.stack([self._window(self.held_chat, int(s), n) for s in starts])


# ----------------------------------------------------------------------------------------------------------------------
# Model: init, training taps, loss
# ----------------------------------------------------------------------------------------------------------------------


def init_params(model, cfg, seed: int) -> None:
    """Fills our (zero-created) parameters: fan-in normal for projections, output projections scaled down by
    sqrt(2 * layers), zero offsets for the zero-centred RMSNorms, ones for the gated norm, Qwen3-Next-style decay
    parameters, a zero PLE conv (as HF initialises it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    key = jax.random.key(seed)
    out_scale = 1.0 / math.sqrt(2 * (cfg.num_layers + 1))
    for i, (path, param) in enumerate(sorted(
        ((p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)), key=lambda pv: str(pv[0])
    )):
        name = ".".join(str(p) for p in path)
        leaf = path[-1]
        parent = str(path[-2]) if len(path) > 1 else ""
        shape = tuple(param.shape)
        k = jax.random.fold_in(key, i)
        normal = functools.partial(_scaled_normal, k, shape)
        if leaf == "A_log":
            value = jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        elif leaf == "dt_bias":
            value = jnp.ones(shape, jnp.float32)
        elif parent == "conv1d":
            value = jnp.zeros(shape) if ".ple." in name else normal(1.0 / math.sqrt(shape[-1]))
        elif leaf == "weight" and len(shape) == 1:  # norms
            value = jnp.ones(shape) if name.endswith("linear_attn.norm.weight") else jnp.zeros(shape)
        elif parent == "embed_tokens":
            value = normal(1.0)
        elif parent == "gate" and "mlp" in name:  # router
            value = normal(0.1 / math.sqrt(shape[-1]))
        elif leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:  # fused experts [E, out, in]
            value = normal(1.0 / math.sqrt(shape[-1])) * (out_scale if leaf == "down_proj" else 1.0)
        elif len(shape) == 2:
            value = normal(1.0 / math.sqrt(shape[-1]))
            if parent in ("o_proj", "out_proj", "down_proj", "value_proj"):
                value = value * out_scale
        else:
            raise ValueError(f"no init rule for {name} {shape}")
        param.set_value(value.astype(param.dtype))


def _scaled_normal(key, shape, std):
    import jax
    import jax.numpy as jnp

    return std * jax.random.normal(key, shape, jnp.float32)


_TAPS: list | None = None  # aux losses recorded while tracing the training loss


@contextlib.contextmanager
def training_taps(cfg):
    """Wraps the router and the attention so that, while tracing the training loss, they record a Switch-style
    load-balancing loss and the QSA indexer's distillation loss; and picks CPU-friendly forms of two kernels
    (block-sorted experts, the recurrent delta rule) that compute the same function. Restores everything on exit."""
    global _TAPS
    import jax
    import jax.numpy as jnp

    from strata_jax.model import attention as attention_mod
    from strata_jax.model import deltanet as deltanet_mod
    from strata_jax.model import moe as moe_mod
    from strata_jax.model.layers import apply_rope, rope_cos_sin

    router_call, attn_call = moe_mod.Router.__call__, attention_mod.Attention.__call__
    experts_call = moe_mod.Experts.__call__
    recurrent_max = deltanet_mod.RECURRENT_MAX_TOKENS

    def router(self, x):
        logits = router_call(self, x)
        if _TAPS is not None:
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            _, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
            frac = jnp.mean(jnp.sum(jax.nn.one_hot(ids, cfg.num_experts), axis=1), axis=0) / cfg.num_experts_per_tok
            _TAPS.append(("balance", cfg.num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))))
        return logits

    def attention(self, x, cache, start, n_valid):
        out = attn_call(self, x, cache, start, n_valid)
        if _TAPS is not None and cfg.qsa:
            _TAPS.append(("indexer", _indexer_kl(self, jax.lax.stop_gradient(x), start, apply_rope, rope_cos_sin)))
        return out

    def experts(self, x, ids, weights, valid=None):
        return blocked_experts(x, ids, weights, self.gate_up_proj[...], self.down_proj[...])

    moe_mod.Router.__call__, attention_mod.Attention.__call__ = router, attention
    moe_mod.Experts.__call__ = experts
    # The token-by-token delta rule (same arithmetic as the chunked one) is much faster on a CPU at these sizes.
    deltanet_mod.RECURRENT_MAX_TOKENS = 1 << 30
    _TAPS = []
    try:
        yield _TAPS
    finally:
        _TAPS = None
        moe_mod.Router.__call__, attention_mod.Attention.__call__ = router_call, attn_call
        moe_mod.Experts.__call__ = experts_call
        deltanet_mod.RECURRENT_MAX_TOKENS = recurrent_max


def blocked_experts(x, ids, weights, gate_up, down, block: int = 128):
    """The same function as `experts_reference` (sum_k w_k * expert_k(x)), computed the way grouped-GEMM kernels do:
    (token, expert) pairs sorted by expert into blocks of `block` rows that each belong to one expert (groups padded
    to whole blocks), one batched matmul over the blocks. ~2.5x faster than all-experts-dense and ~10x faster than
    ragged_dot (forward + backward) on a CPU at this size."""
    import jax
    import jax.numpy as jnp

    n, k = ids.shape
    n_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_of = flat[order]
    sizes = jnp.bincount(flat, length=n_experts)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    dest = (padded_end - padded)[expert_of] + jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[expert_of]
    n_blocks = -(-(n * k + n_experts * (block - 1)) // block)
    token_of = order // k
    xs = jnp.zeros((n_blocks * block, x.shape[-1]), gate_up.dtype).at[dest].set(x[token_of].astype(gate_up.dtype))
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_blocks) * block, side="right"),
                               n_experts - 1)
    gu = jnp.einsum("bmh,boh->bmo", xs.reshape(n_blocks, block, -1), gate_up[block_expert])
    act = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    out = jnp.einsum("bmi,bhi->bmh", act, down[block_expert]).reshape(n_blocks * block, -1)
    out = out[dest].astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(out).astype(x.dtype)


def _indexer_kl(attn, x, start, apply_rope, rope_cos_sin):
    """KL(attention block mass || softmax(indexer block scores)) over complete blocks, averaged over the queries
    that end a block (a quarter of them, to save time).

    The target is the layer's own causal attention (all heads, no selection), pooled over blocks of compress_ratio
    keys; only the indexer's weights get gradients (x is detached by the caller, the target is stopped)."""
    import jax
    import jax.numpy as jnp

    cfg = attn.cfg
    b, t, _ = x.shape
    d, kvh, c = cfg.head_dim, cfg.num_kv_heads, cfg.indexer_compress_ratio
    positions = start[:, None] + jnp.arange(t)[None, :]
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    qpos = jnp.arange(c - 1, t, c)  # queries that end a block
    qcos, qsin = cos[:, c - 1::c], sin[:, c - 1::c]
    q = attn.q_proj(x[:, c - 1::c]).reshape(b, -1, cfg.num_heads, 2 * d)[..., :d]
    q = apply_rope(attn.q_norm(q), qcos, qsin).reshape(b, -1, kvh, cfg.num_heads // kvh, d)
    k = apply_rope(attn.k_norm(attn.k_proj(x).reshape(b, t, kvh, d)), cos, sin)
    causal = jnp.arange(t)[None, :] <= qpos[:, None]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * d**-0.5
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    n_blocks = t // c
    mass = jnp.mean(probs, axis=(1, 2)).reshape(b, len(qpos), n_blocks, c).sum(-1)  # [B, Q, NB]
    complete = jnp.arange(n_blocks)[None, :] < ((qpos + 1) // c)[:, None]  # [Q, NB]
    mass = jnp.where(complete, mass, 0.0)
    target = jax.lax.stop_gradient(mass / jnp.maximum(mass.sum(-1, keepdims=True), 1e-9))

    idx = attn.indexer
    di, nh = cfg.indexer_head_dim, cfg.indexer_n_heads
    qk = idx.index_qk_proj(x)
    iq = apply_rope(idx.q_layernorm(qk[:, c - 1::c, : nh * di].reshape(b, -1, nh, di)), qcos, qsin)
    pooled = idx.k_layernorm(jnp.mean(qk[..., nh * di:].reshape(b, n_blocks, c, di), axis=2))
    bcos, bsin = rope_cos_sin(jnp.arange(n_blocks) * c, cfg.rotary_dim, cfg.rope_theta)
    bk = apply_rope(pooled[:, :, None, :], bcos, bsin)[:, :, 0, :]
    iscore = jnp.sum(jax.nn.relu(jnp.einsum("bthd,bnd->btnh", iq, bk)), axis=-1) / math.sqrt(di)
    logp = jax.nn.log_softmax(jnp.where(complete, iscore, -1e9), axis=-1)
    kl = jnp.sum(jnp.where(complete, target * (jnp.log(jnp.maximum(target, 1e-9)) - logp), 0.0), axis=-1)
    has = complete.any(-1)
    return jnp.sum(kl * has) / (b * jnp.maximum(jnp.sum(has), 1))


def make_loss(graphdef, cfg, seq_len: int, mtp_weight: float, balance_weight: float, indexer_weight: float):
    """loss(params, windows [B, T+2], ple_ids [B, T, heads]) -> (total, metrics). params = {"model", "ple"}."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from strata_jax.model.cache import init_cache

    def loss_fn(params, windows, ple_ids):
        model = nnx.merge(graphdef, params["model"])
        b = windows.shape[0]
        x, y, y2 = windows[:, :seq_len], windows[:, 1:seq_len + 1], windows[:, 2:seq_len + 2]
        cache = init_cache(cfg, b, seq_len, jnp.float32, with_mtp=True)
        n_valid = jnp.full((b,), seq_len, jnp.int32)
        rows = params["ple"][ple_ids].reshape(b, seq_len, -1)
        with training_taps(cfg) as taps:
            logits, hidden, cache = model(x, cache, n_valid, (rows,))
            mtp_logits, _ = model.mtp_logits(y, hidden, cache, n_valid)
            aux = list(taps)
        main = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, y2).mean()
        balance = sum(v for k, v in aux if k == "balance") / max(1, sum(1 for k, _ in aux if k == "balance"))
        indexer = sum(v for k, v in aux if k == "indexer") / max(1, sum(1 for k, _ in aux if k == "indexer"))
        total = main + mtp_weight * mtp + balance_weight * balance + indexer_weight * indexer
        return total, {"loss": main, "mtp": mtp, "balance": balance, "indexer": indexer}

    return loss_fn


def ple_row_ids(hasher, windows: np.ndarray, seq_len: int) -> np.ndarray:
    x = windows[:, :seq_len]
    return hasher.row_ids(hasher.initial_context(x.shape[0]), x).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------------
# Export and evaluation
# ----------------------------------------------------------------------------------------------------------------------


def export_checkpoint(out: Path, model, cfg, ple_table, config: dict) -> int:
    """Writes config.json, generation_config.json and model.safetensors (bf16). Returns the tensor count."""
    import ml_dtypes
    from flax import nnx
    from safetensors.numpy import save_file

    from strata_jax.weights.loader import hf_name

    tensors = {}
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            name = hf_name(cfg, ".".join(str(p) for p in path))
            tensors[name] = np.asarray(param[...], np.float32).astype(ml_dtypes.bfloat16)
    for layer in cfg.ple_layers:
        name = f"{cfg.weight_prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
        tensors[name] = np.asarray(ple_table, np.float32).astype(ml_dtypes.bfloat16)
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"eos_token_id": [config["eos_token_id"], config["pad_token_id"]], "pad_token_id": config["pad_token_id"],
           "do_sample": False, "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return len(tensors)


def evaluate_loaded(lm, windows: np.ndarray, with_mtp: bool) -> dict:
    """Per-token held-out loss of a `LoadedModel` on windows [N, T+2] (one sequence per row, from position 0) and,
    with `with_mtp`, the MTP head's top-1 accuracy at guessing token t+2."""
    seq = windows.shape[1] - 2
    nll, count, mtp_hits, mtp_count = 0.0, 0, 0, 0
    for row in windows:
        x = row[None, :seq]
        seqs = lm.start(1, seq)
        logits, hidden, seqs = lm.step(seqs, x)
        logp = logits[0] - _logsumexp(logits[0])
        nll -= float(np.sum(logp[np.arange(seq), row[1:seq + 1]]))
        count += seq
        if with_mtp:
            mtp_logits, _ = lm.mtp_step(seqs, row[None, 1:seq + 1], hidden)
            mtp_hits += int(np.sum(np.argmax(mtp_logits[0], -1) == row[2:seq + 2]))
            mtp_count += seq
    out = {"loss": nll / count, "tokens": count}
    if with_mtp:
        out["mtp_top1"] = mtp_hits / mtp_count
    return out


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


SAMPLE_PROMPTS = [
    ("chat", "Write a Python function that reverses a string."),
    ("chat", "Write a function that checks whether a number is even."),
    ("raw", "def fibonacci(n):"),
    ("raw", "import os\n\n\ndef list_python_files(directory):\n"),
    ("tools", "What is in src/utils.py?"),
]


def sample_outputs(lm, max_new_tokens: int = 96) -> list[dict]:
    tok = lm.tokenizer
    out = []
    for kind, text in SAMPLE_PROMPTS:
        if kind == "raw":
            prompt = text
        else:
            tools = [_tool_schema("read_file"), _tool_schema("run_command")] if kind == "tools" else None
            prompt = tok.apply_chat_template([{"role": "user", "content": text}], tools=tools,
                                             add_generation_prompt=True)
        ids = lm.generate(tok.encode(prompt), max_new_tokens=max_new_tokens)
        out.append({"kind": kind, "prompt": text, "output": tok.decode(ids)})
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} CPU"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.train_demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="strata_jax/demo", help="output directory (HF layout)")
    p.add_argument("--steps", type=int, default=850, help="optimizer steps (the LR schedule spans them)")
    p.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes (early stop; "
                   "the LR schedule still assumes --steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=6, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=384, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--balance-weight", type=float, default=0.01)
    p.add_argument("--indexer-weight", type=float, default=0.1)
    p.add_argument("--eval-windows", type=int, default=24, help="held-out windows for the final evaluation")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--skip-final-eval", action="store_true", help="export only (no quantized evaluation)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import tempfile

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from strata_jax import load_model
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.decoder import CausalLM
    from strata_jax.model.ple_hash import NgramHasher

    command = "python -m tools.train_demo " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    # -- data and tokenizer ----------------------------------------------------------------------------------------
    root, train_files, held_files = stdlib_files()
    code_texts, held_code = read_sources(root, train_files), read_sources(root, held_files)
    convs = chat_conversations(args.seed, N_CHAT)
    with tempfile.TemporaryDirectory() as tmp:
        renderer = template_renderer(Path(tmp))
        chat_texts = [render_conversation(renderer, *c) for c in convs]
    train_chat = [t for i, t in enumerate(chat_texts) if i % 10]
    held_chat = [t for i, t in enumerate(chat_texts) if i % 10 == 0]
    log(f"corpus: {len(code_texts)} stdlib files ({sum(map(len, code_texts)) / 1e6:.1f} MB) for training, "
        f"{len(held_code)} held out; {len(train_chat)} chat conversations, {len(held_chat)} held out")
    tok = train_tokenizer(code_texts[::TOKENIZER_TRAIN_EVERY], train_chat)
    write_tokenizer(tok, out)
    snippets = code_snippets(args.seed)
    corpus = Corpus(tok, code_texts, train_chat, held_code, held_chat, snippets)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; tokens: code {len(corpus.code):,}, chat {len(corpus.chat):,} "
        f"(conversation length median {int(np.median(corpus.chat_lengths))}, max {int(corpus.chat_lengths.max())}), "
        f"held-out code {len(corpus.held_code):,}")

    # -- model ---------------------------------------------------------------------------------------------------
    config = hf_config(tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    cfg = ModelConfig.from_hf_dict(config)
    model = CausalLM(cfg, jnp.float32, with_mtp=True)
    init_params(model, cfg, args.seed)
    hasher = NgramHasher.for_layer(cfg, 0)
    ple_dim = cfg.ple_embed_dim // cfg.ple_ngram_heads
    ple_table = jax.random.normal(jax.random.key(args.seed + 1), (hasher.table_rows, ple_dim), jnp.float32)
    graphdef, state = nnx.split(model)
    params = {"model": state, "ple": ple_table}
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    n_expert = sum(int(np.prod(v.shape)) for p, v in nnx.iter_graph(model)
                   if isinstance(v, nnx.Param) and p[-1] in ("gate_up_proj", "down_proj") and len(v.shape) == 3)
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_expert / 1e6:.2f}M in routed experts, "
        f"{ple_table.size / 1e6:.2f}M in the PLE table)")

    # -- optimizer -------------------------------------------------------------------------------------------------
    warmup = min(args.warmup, max(1, args.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.1)

    def decay_mask(tree):
        def leaf_mask(path, x):
            top = getattr(path[0], "key", None)
            return x.ndim >= 2 and top != "ple" and "embed_tokens" not in jax.tree_util.keystr(path)
        return jax.tree_util.tree_map_with_path(leaf_mask, tree)

    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )
    opt_state = opt.init(params)
    loss_fn = make_loss(graphdef, cfg, args.seq_len, args.mtp_weight, args.balance_weight, args.indexer_weight)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, windows, ple_ids):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, windows, ple_ids)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["grad_norm"] = optax.global_norm(grads)
        return params, opt_state, metrics

    eval_fn = jax.jit(lambda p, w, ids: loss_fn(p, w, ids)[1])
    n = args.seq_len + 2
    quick_eval = corpus.eval_windows("code", 4, n)
    quick_ids = ple_row_ids(hasher, quick_eval, args.seq_len)

    # -- training --------------------------------------------------------------------------------------------------
    rng = np.random.default_rng(args.seed)
    tokens_per_step = args.batch * args.seq_len
    train_started = time.time()
    last_t, last_step = train_started, 0
    history = []
    step = 0
    stopped_early = False
    for step in range(1, args.steps + 1):
        windows = corpus.batch(rng, args.batch, n)
        ids = ple_row_ids(hasher, windows, args.seq_len)
        params, opt_state, metrics = train_step(params, opt_state, jnp.asarray(windows), jnp.asarray(ids))
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            m = {k: float(v) for k, v in metrics.items()}
            now = time.time()
            tps = (step - last_step) * tokens_per_step / max(now - last_t, 1e-9)
            last_t, last_step = now, step
            line = (f"step {step}/{args.steps} loss {m['loss']:.3f} mtp {m['mtp']:.3f} balance {m['balance']:.3f} "
                    f"indexer {m['indexer']:.3f} gnorm {m['grad_norm']:.2f} lr {float(schedule(step)):.2e} "
                    f"{tps:,.0f} tok/s")
            if step % (args.log_every * 10) == 0 or step == args.steps:
                ev = {k: float(v) for k, v in eval_fn(params, jnp.asarray(quick_eval), jnp.asarray(quick_ids)).items()}
                line += f" | held-out loss {ev['loss']:.3f} mtp {ev['mtp']:.3f}"
                m["heldout"] = ev["loss"]
            history.append({"step": step, **m})
            log(line)
        if args.minutes is not None and time.time() - train_started > args.minutes * 60:
            stopped_early = step < args.steps
            log(f"--minutes {args.minutes} reached at step {step}")
            break
    train_wall = time.time() - train_started
    final_train = history[-1] if history else {}
    log(f"training done: {step} steps, {step * tokens_per_step:,} tokens in {train_wall / 60:.1f} min")

    # -- export ----------------------------------------------------------------------------------------------------
    nnx.update(model, params["model"])
    n_tensors = export_checkpoint(out, model, cfg, np.asarray(params["ple"]), config)
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    log(f"exported {n_tensors} tensors to {out} ({size_mb:.1f} MB)")

    run = {
        "command": command, "steps": step, "planned_steps": args.steps, "stopped_early": stopped_early,
        "train_wall_s": round(train_wall, 1), "total_wall_s": None, "tokens": step * tokens_per_step,
        "batch": args.batch, "seq_len": args.seq_len, "params": n_params, "expert_params": n_expert,
        "ple_params": int(ple_table.size), "final_train": final_train, "history": history,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, jax {jax.__version__} on {jax.default_backend()}",
        "corpus": {
            "stdlib": str(root), "train_files": len(code_texts), "heldout_files": len(held_code),
            "code_tokens": len(corpus.code), "chat_tokens": len(corpus.chat),
            "chat_conversations": len(train_chat), "heldout_conversations": len(held_chat),
            "chat_fraction": CHAT_FRACTION, "heldout_code_tokens": len(corpus.held_code),
            "snippets": len(snippets), "snippet_tokens": len(corpus.snippets), "snippet_fraction": SNIPPET_FRACTION,
        },
    }
    # The same windows through the training path (float32, CPU-friendly kernels) for the consistency check below.
    check = corpus.eval_windows("code", args.eval_windows, n)[:4]
    run["train_path_loss"] = float(eval_fn(params, jnp.asarray(check), jnp.asarray(ple_row_ids(hasher, check,
                                                                                            args.seq_len)))["loss"])
    if not args.skip_final_eval:
        run["eval"] = final_evaluation(out, corpus, n, args.eval_windows, log)
        f32 = evaluate_loaded(load_model(out, dtype="float32"), check, with_mtp=False)["loss"]
        run["eval"]["consistency"] = {"train_path_f32": run["train_path_loss"], "load_model_f32_bf16_weights": f32}
        log(f"consistency: loss on 4 held-out windows {run['train_path_loss']:.4f} (training path, f32 weights) vs "
            f"{f32:.4f} (load_model float32 on the exported bf16 weights)")
    run["total_wall_s"] = round(time.time() - started, 1)
    (out / "training_run.json").write_text(json.dumps(run, indent=1) + "\n")
    write_readme(out, run, cfg, config)
    log(f"wrote {out / 'README.md'}")


def final_evaluation(out: Path, corpus: Corpus, n: int, count: int, log) -> dict:
    """Loads the exported checkpoint through the public API: bf16, then experts quantized to 1/2/3 planes."""
    from strata_jax import load_model

    code = corpus.eval_windows("code", count, n)
    chat = corpus.eval_windows("chat", count, n)
    results = {"code_windows": int(code.shape[0]), "chat_windows": int(chat.shape[0]), "window_tokens": n - 2}
    for label, kwargs in [("bf16", {}), ("1bit_p1", {"quantize": "1bit", "planes": 1, "group": 64}),
                          ("1bit_p2", {"quantize": "1bit", "planes": 2, "group": 64}),
                          ("1bit_p3", {"quantize": "1bit", "planes": 3, "group": 64})]:
        t0 = time.time()
        lm = load_model(out, dtype="bfloat16", **kwargs)
        r = {"code": evaluate_loaded(lm, code, with_mtp=label == "bf16"), "chat": evaluate_loaded(lm, chat, False)}
        if label == "bf16":
            r["samples"] = sample_outputs(lm)
            for s in r["samples"]:
                log(f"sample [{s['kind']}] {s['prompt']!r} -> {s['output']!r}")
        results[label] = r
        log(f"eval {label}: held-out code loss {r['code']['loss']:.3f}, chat loss {r['chat']['loss']:.3f}"
            + (f", MTP top-1 {r['code']['mtp_top1']:.3f}" if "mtp_top1" in r["code"] else "")
            + f" ({time.time() - t0:.0f}s)")
    return results


def write_readme(out: Path, run: dict, cfg, config: dict) -> None:
    ev = run.get("eval")
    c = run["corpus"]
    lines = [
        "# Demo model (strata_jax)",
        "",
        "A tiny `qwen4_exp` text model (\"Qwen3.8-Flash-Next\" architecture) trained from scratch by",
        "`tools/train_demo.py` so that the server, the drafter and the quantizer can be judged on a model that",
        "writes code-like Python instead of noise. It is tiny and was trained for minutes on a CPU: expect",
        "plausible-looking, often wrong code.",
        "",
        "## Architecture",
        "",
        (f"hidden {cfg.hidden_size}, {cfg.num_layers} layers ({', '.join(config['layer_types'])}), vocab "
        f"{cfg.vocab_size} (byte-level BPE); Gated DeltaNet {cfg.linear_num_k_heads}/{cfg.linear_num_v_heads} heads "
        f"of {cfg.linear_k_dim}; gated attention {cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim} with the QSA "
        f"indexer ({cfg.indexer_n_heads} heads x {cfg.indexer_head_dim}, budget {cfg.indexer_budget}, compress "
        f"{cfg.indexer_compress_ratio}); MoE {cfg.num_experts} experts top-{cfg.num_experts_per_tok} (intermediate "
        f"{cfg.moe_intermediate_size}) + shared expert ({cfg.shared_expert_intermediate_size}); {cfg.hc_count} "
        f"hyper-connection streams (low rank {cfg.hc_lowrank}); PLE on layer {config['ple_layer_ids']} (one-indexed; "
        f"{cfg.ple_ngram_heads} hashed 2/3-gram heads, table {run['ple_params'] / 1e6:.2f}M parameters); one MTP "
        f"layer (`mtp.*`, an indexed-attention decoder layer predicting token t+2)."),
        (f"{run['params'] / 1e6:.2f}M parameters in all ({run['expert_params'] / 1e6:.2f}M in routed experts), "
        "stored in bf16."),
        "",
        "## Training",
        "",
        "```bash",
        run["command"],
        "```",
        "",
        f"* date: {run['date']}; machine: {run['machine']}"
        + (" (shared with other jobs while training; no GPU)." if run["machine"].endswith("on cpu") else "."),
        f"* {run['steps']} steps" + (f" of {run['planned_steps']} planned (stopped by --minutes)"
                                     if run["stopped_early"] else "")
        + f" x {run['batch']} sequences x {run['seq_len']} tokens = {run['tokens']:,} tokens; "
        f"training wall time {run['train_wall_s'] / 60:.1f} min, whole script {run['total_wall_s'] / 60:.1f} min.",
        ("* optax AdamW (b2 0.95, weight decay on matrices), linear warmup + cosine decay to 10%, gradient clip 1.0, "
        "float32 on the CPU; fixed seeds (same command, same weights)."),
        ("* losses: next token + 0.3 x MTP (t+2, fed the main model's final hidden state at t and the embedding of "
        "t+1) + 0.01 x router load balance + 0.1 x QSA indexer distillation (KL from the attention's own block mass "
        "to the indexer's scores, on a detached input)."),
        (f"* final training batch: loss {run['final_train'].get('loss', float('nan')):.3f}, "
        f"MTP loss {run['final_train'].get('mtp', float('nan')):.3f}."),
        "",
        "## Data",
        "",
        (f"* Python standard library of the training interpreter (`{c['stdlib']}`): sorted `*.py` files without "
        f"`test/`, `tests/`, `idle_test/`, `encodings/`, `pydoc_data/` and files over {MAX_FILE_BYTES // 1000} kB; every "
        f"{HOLDOUT_EVERY}th file held out ({c['train_files']} training files = {c['code_tokens']:,} tokens; "
        f"{c['heldout_files']} held-out files = {c['heldout_code_tokens']:,} tokens). Random windows."),
        (f"* {c['chat_conversations'] + c['heldout_conversations']} synthetic conversations generated by the script "
        f"(every 10th held out), rendered through the chat template: instructions answered with code (functions and "
        f"small classes, with a `<think>` trace, an empty think block as `enable_thinking=False` renders, or none), "
        f"\"what does this code do\" questions, and tool use (1-3 tools in the system turn; read/write files, run "
        f"commands and Python, search, list, weather) with `<tool_call>` XML calls, `<tool_response>` turns and final "
        f"answers. {c['chat_tokens']:,} tokens; {int(c['chat_fraction'] * 100)}% of training rows start at a "
        "conversation."),
        (f"* {c['snippets']} synthetic snippets: the code of the same tasks as small files of their own (as is, with "
         f"a docstring, after a comment line); {c['snippet_tokens']:,} tokens; {int(c['snippet_fraction'] * 100)}% "
         "of training rows start at one."),
        ("* Rows that start at a conversation or snippet continue with the documents that follow it; documents are "
         "separated by `<|endoftext|>`."),
        "",
    ]
    if ev:
        lines += [
            "## Evaluation (exported checkpoint, `strata_jax.load_model`)",
            "",
            (f"Per-token loss (nats) on {ev['code_windows']} held-out stdlib windows and {ev['chat_windows']} held-out "
            f"conversations of {ev['window_tokens']} tokens, each from position 0; weights and activations bf16; "
            "the quantized rows quantize the routed experts on load (`quantize=\"1bit\", group=64`)."),
            "",
            "| experts | held-out code loss | held-out chat loss |",
            "| --- | --- | --- |",
        ]
        for label, name in [("bf16", "bf16 (dense)"), ("1bit_p1", "1 bit-plane"), ("1bit_p2", "2 bit-planes"),
                            ("1bit_p3", "3 bit-planes")]:
            lines.append(f"| {name} | {ev[label]['code']['loss']:.3f} | {ev[label]['chat']['loss']:.3f} |")
        lines += [
            "",
            (f"MTP head top-1 accuracy on the held-out code windows (its guess of token t+2 equals the actual token): "
            f"{ev['bf16']['code']['mtp_top1']:.3f}."),
            "",
            ("Consistency check: on 4 of those windows the training code path (float32 weights; block-sorted experts "
             "and the recurrent delta rule) gives "
            f"{ev['consistency']['train_path_f32']:.4f} and `load_model(dtype=\"float32\")` on the exported bf16 "
            f"weights {ev['consistency']['load_model_f32_bf16_weights']:.4f}."),
            "",
            "## Samples (greedy, bf16)",
            "",
        ]
        for s in ev["bf16"]["samples"]:
            lines += [f"{s['kind']} prompt: `{s['prompt']!r}`", "", "````text", s["output"], "````", ""]
    lines += [
        "## Files",
        "",
        "config.json, model.safetensors (bf16; names are the HF names; experts fused `[E, 2I, H]` / `[E, H, I]`; the",
        "PLE table under `model.layers.1.ple.ple_embedding.ngram_embedding.weight`; `mtp.*`), tokenizer.json,",
        "tokenizer_config.json (chat template), generation_config.json, training_run.json (the run's log and numbers).",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
