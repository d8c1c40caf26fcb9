"""RULER-style synthetic tasks (``--task ruler_multikey``, ``ruler_multivalue``, ``ruler_variables``,
``ruler_common_words``, ``ruler_multiquery``, ``ruler_frequent_words``, or ``ruler`` for all six): rows of an exact token length whose answer
needs more than finding one needle, scored by teacher forcing (Note [Scoring RULER-style tasks
by teacher forcing]). The task definitions follow RULER (Hsieh et al., 2024, "RULER: What's the
Real Context Size of Your Long-Context Language Models?"); the wording, the made-up words and
the sizes are ours:

- ``ruler_multikey``: four needles "the special magic number for <key> is: <7 digits>", each
  with its own key, hidden in the filler; the question asks for one key's number.
- ``ruler_multivalue``: four needles of the same form and the same key, each with its own number;
  the answer is all four numbers, in the order they appear.
- ``ruler_variables``: a chain "VAR A = 12345", "VAR B = VAR A", ... of five variables and a
  second chain of five holding another value, interleaved in the filler; the answer names the
  five variables that hold the asked value, in the order they are assigned.
- ``ruler_common_words``: a list of made-up words in which three appear 8 times and every other
  word at most twice; the answer names the three, in the order they first appear.
- ``ruler_multiquery``: four needles as in ``ruler_multikey``; the question asks for three of the
  keys' numbers, in an order of its own, and the answer gives them in that order.
- ``ruler_frequent_words``: a list of made-up words drawn from a Zipf-like distribution over a
  small vocabulary, trimmed so that the three most frequent have distinct counts, each above
  every other word's; the answer names the three, most frequent first.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llama_cp.data.packing import _pack, _pad_id
from llama_cp.data.passkey import PASSKEY_FILLER
from llama_cp.eval.plots import _save_figure
from llama_cp.model.loss import IGNORE_INDEX, causal_lm_loss_sum
from llama_cp.parallel.mesh import submesh
from llama_cp.parallel.sharding import shard_batch

#: --task ruler runs these six, in this order.
RULER_TASKS = ("ruler_multikey", "ruler_multivalue", "ruler_variables", "ruler_common_words", "ruler_multiquery",
               "ruler_frequent_words")
RULER = "ruler"

# Note [Scoring RULER-style tasks by teacher forcing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# RULER generates an answer and matches strings. We run the whole row, answer
# included, through one forward and take the argmax at every answer position:
#
#   ... question <reply opens> The special magic numbers for X are: 123, 456
#                                                                  ^^^^^^^^^ labels
#   right  <=>  argmax(logits[t]) == input_ids[t + 1] for every labelled t
#
# That is greedy decoding's exact match: if every answer token is the argmax
# given the tokens before it, greedy decoding writes those tokens one by one,
# and if greedy decoding writes them, each was the argmax at its step. What
# greedy decoding would write after the answer is not looked at, and the
# answer must come in our tokenization and our order (RULER's string match
# takes any order for the multi-answer tasks; ours is stricter there).
# Why not generate: under context parallelism each rank holds a slice of the
# row, so decoding would need a KV cache sharded over the cp ranks and a new
# token appended to one of them at every step; one forward per row needs
# nothing the training path does not have. The fraction of answer tokens
# right (token_accuracy) and their loss are kept too: a small model is often
# at 0 accuracy where these still move.

#: Made-up words (keys, list words) are three syllables of these: 70**3 words, none of them English.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
NEEDLES, VALUE_DIGITS = 4, 7
CHAIN, VARIABLE_DIGITS = 5, 5
COMMON_WORDS, COMMON_TIMES, RARE_TIMES = 3, 8, 2
QUERIES = 3  # ruler_multiquery: keys asked, of the NEEDLES
FREQUENT_WORDS, VOCABULARY, ZIPF_EXPONENT = 3, 50, 1.0  # ruler_frequent_words: word k drawn with weight 1 / k**1.0


@dataclass(frozen=True)
class Draw:
    """One drawn sample of a task, before it is fitted to a length."""

    intro: str  # opens the user's turn
    question: str  # after the context
    prefix: str  # opens the reply; the answer follows it
    answer: str  # the scored text; starts with a space, so it tokenizes as it would after the prefix
    context: Callable[[int], list[int]]  # exactly n tokens of context


def _words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct made-up words."""
    n = len(_SYLLABLES)
    return ["".join(_SYLLABLES[code // n**k % n] for k in range(3)) for code in rng.sample(range(n**3), count)]


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def hide(rng: random.Random, budget: int, inserts: Sequence[list[int]], filler: Sequence[list[int]],
         task: str) -> list[int]:
    """Exactly ``budget`` tokens: filler sentences (cut at the front) with ``inserts`` put in, in
    order, at sentence boundaries below depths drawn from ``rng`` (sorted, so the order holds)."""
    room = budget - sum(len(insert) for insert in inserts)
    if room < 0:
        raise ValueError(f"too short for --task {task}: its context needs {-room} tokens more")
    starts, stream = [], []  # starts: offset of each filler sentence in the stream
    while len(stream) < room:
        starts.append(len(stream))
        stream += filler[(len(starts) - 1) % len(filler)]
    excess = len(stream) - room
    stream = stream[excess:]
    boundaries = [start - excess for start in starts if start >= excess] + [room]
    context, done = [], 0
    for depth, insert in zip(sorted(rng.random() for _ in inserts), inserts):
        at = max((b for b in boundaries if b <= depth * room), default=boundaries[0])
        context += stream[done:at] + insert
        done = at
    return context + stream[done:]


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}. "


def draw_multikey(rng, encode, filler) -> Draw:
    keys = _words(rng, NEEDLES)
    values = [_number(rng, VALUE_DIGITS) for _ in keys]
    asked = rng.randrange(NEEDLES)
    needles = [encode(_magic(key, value)) for key, value in zip(keys, values)]
    return Draw(intro="Some special magic numbers are hidden in the text below. Remember them: a question about "
                      "them follows.\n",
                question=f"\nWhat is the special magic number for {keys[asked]} mentioned in the text above?",
                prefix=f"The special magic number for {keys[asked]} mentioned in the text above is:",
                answer=f" {values[asked]}",
                context=lambda budget: hide(rng, budget, needles, filler, "ruler_multikey"))


def draw_multivalue(rng, encode, filler) -> Draw:
    (key,) = _words(rng, 1)
    values = [_number(rng, VALUE_DIGITS) for _ in range(NEEDLES)]
    needles = [encode(_magic(key, value)) for value in values]
    return Draw(intro="Some special magic numbers are hidden in the text below. Remember them: a question about "
                      "them follows.\n",
                question=f"\nWhat are all the special magic numbers for {key} mentioned in the text above? "
                         "Give them in the order they appear.",
                prefix=f"The special magic numbers for {key} mentioned in the text above are:",
                answer=" " + ", ".join(values),
                context=lambda budget: hide(rng, budget, needles, filler, "ruler_multivalue"))


def draw_variables(rng, encode, filler) -> Draw:
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(4 * CHAIN)]
    names = list(dict.fromkeys(names))[: 2 * CHAIN]  # distinct (20 draws leave 10 but for ~1e-12)
    values = [_number(rng, VARIABLE_DIGITS), _number(rng, VARIABLE_DIGITS)]
    while values[1] == values[0]:
        values[1] = _number(rng, VARIABLE_DIGITS)
    chains = [[f"VAR {names[c * CHAIN]} = {values[c]}. "]
              + [f"VAR {names[c * CHAIN + i]} = VAR {names[c * CHAIN + i - 1]}. " for i in range(1, CHAIN)]
              for c in range(2)]
    order = [0] * CHAIN + [1] * CHAIN  # interleave the chains, each in its own order
    rng.shuffle(order)
    statements = [chains[c].pop(0) for c in order]
    inserts = [encode(statement) for statement in statements]
    return Draw(intro="Track the chains of variable assignments hidden in the text below.\n",
                question=f"\nFind every variable that holds the value {values[0]}, directly or through another "
                         "variable, in the text above. Name them in the order they are assigned.",
                prefix=f"Answer: the variables that hold {values[0]} are:",
                answer=" " + ", ".join(names[:CHAIN]),
                context=lambda budget: hide(rng, budget, inserts, filler, "ruler_variables"))


def draw_common_words(rng, encode, filler) -> Draw:
    common = _words(rng, COMMON_WORDS)  # in the order they first appear, which context() sees to
    head = encode("Here is a list of words:")

    def context(budget: int) -> list[int]:
        listed = common * COMMON_TIMES
        used = len(head) + sum(len(encode(" " + word)) for word in listed)
        fresh = iter(_words(rng, max(budget, 1)))  # never more words than tokens
        for times in (RARE_TIMES, 1):  # rare words twice while they fit, then once
            for word in fresh:
                size = len(encode(" " + word))
                if used + times * size > budget:
                    break
                if word not in common:
                    listed += [word] * times
                    used += times * size
        if used > budget:
            raise ValueError(f"too short for --task ruler_common_words: its list needs {used - budget} tokens more")
        rng.shuffle(listed)
        # rename the common words so that they first appear in the answer's order (their counts stay)
        firsts = [word for word in dict.fromkeys(listed) if word in common]
        rename = dict(zip(firsts, common))
        listed = [rename.get(word, word) for word in listed]
        return hide(rng, budget - used, [], filler, "ruler_common_words") + head + [
            token for word in listed for token in encode(" " + word)]

    return Draw(intro="Below is a list of made-up words. A few of them appear more often than the others.\n",
                question=f"\nWhat are the {COMMON_WORDS} words that appear most often in the list above? Name them "
                         "in the order they first appear.",
                prefix=f"Answer: the {COMMON_WORDS} most common words are:",
                answer=" " + ", ".join(common), context=context)


def draw_multiquery(rng, encode, filler) -> Draw:
    keys = _words(rng, NEEDLES)
    values = [_number(rng, VALUE_DIGITS) for _ in keys]
    asked = rng.sample(range(NEEDLES), QUERIES)  # the question's order, not the needles'
    named = ", ".join(keys[i] for i in asked[:-1]) + f" and {keys[asked[-1]]}"
    needles = [encode(_magic(key, value)) for key, value in zip(keys, values)]
    return Draw(intro="Some special magic numbers are hidden in the text below. Remember them: a question about "
                      "them follows.\n",
                question=f"\nWhat are the special magic numbers for {named} mentioned in the text above? Give them "
                         "in the order the keys are asked.",
                prefix=f"The special magic numbers for {named} mentioned in the text above are:",
                answer=" " + ", ".join(values[i] for i in asked),
                context=lambda budget: hide(rng, budget, needles, filler, "ruler_multiquery"))


def _separate_top(counts: dict[str, int], top: int) -> dict[str, int]:
    """``counts`` cut so that its first ``top`` words have distinct counts in falling order, each
    above every later word's: each word at most one fewer than the one before it (for the first
    ``top``) or than the ``top``-th (for the rest)."""
    words = list(counts)
    counts = dict(counts)
    for rank, word in enumerate(words[1:], 1):
        counts[word] = min(counts[word], counts[words[min(rank, top) - 1]] - 1)
    return counts


def draw_frequent_words(rng, encode, filler) -> Draw:
    vocabulary = _words(rng, VOCABULARY)  # word k is drawn with weight 1 / (k + 1) ** ZIPF_EXPONENT
    cumulative = list(itertools.accumulate(1 / (k + 1) ** ZIPF_EXPONENT for k in range(VOCABULARY)))
    sizes = {word: len(encode(" " + word)) for word in vocabulary}
    head = encode("Here is a list of words:")

    def context(budget: int) -> list[int]:
        # the first three words 3, 2 and 1 times to start: after _separate_top they keep >= 3, 2, 1
        counts = dict.fromkeys(vocabulary, 0) | dict(zip(vocabulary, (3, 2, 1)))
        used = len(head) + sum(sizes[word] * n for word, n in counts.items())
        if used > budget:
            raise ValueError(f"too short for --task ruler_frequent_words: its list needs {used - budget} tokens more")
        while True:  # draw until a word does not fit
            (word,) = rng.choices(vocabulary, cum_weights=cumulative)
            if used + sizes[word] > budget:
                break
            counts[word] += 1
            used += sizes[word]
        # the draws rank the first three first almost always; where they do not, the cut makes them
        counts = _separate_top(counts, FREQUENT_WORDS)
        listed = [word for word, n in counts.items() for _ in range(n)]
        rng.shuffle(listed)
        used = len(head) + sum(sizes[word] for word in listed)  # the cut words' tokens become filler
        return hide(rng, budget - used, [], filler, "ruler_frequent_words") + head + [
            token for word in listed for token in encode(" " + word)]

    return Draw(intro="Below is a list of made-up words, some drawn far more often than others.\n",
                question=f"\nWhat are the {FREQUENT_WORDS} words that appear most often in the list above? Name "
                         "them from the most frequent down.",
                prefix=f"Answer: the {FREQUENT_WORDS} most frequent words, most frequent first, are:",
                answer=" " + ", ".join(vocabulary[:FREQUENT_WORDS]), context=context)


DRAWS = {"ruler_multikey": draw_multikey, "ruler_multivalue": draw_multivalue, "ruler_variables": draw_variables,
         "ruler_common_words": draw_common_words, "ruler_multiquery": draw_multiquery,
         "ruler_frequent_words": draw_frequent_words}


def parse_ruler_task(task: str) -> list[str]:
    """The tasks --task names: one, or all six for ``ruler``."""
    return list(RULER_TASKS) if task == RULER else [task]


def chat_frame(tokenizer) -> tuple[str, str]:
    """(before, after) the user's message: the chat template's text around it, up to the opening
    of the assistant's reply; without a template, the bos token and a line break."""
    if getattr(tokenizer, "chat_template", None):
        mark = "\x00MESSAGE\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                             add_generation_prompt=True)
        before, after = text.split(mark)
        return before, after
    return tokenizer.bos_token or "", "\n"


def ruler_row(task: str, tokenizer, length: int, seed: int, index: int, filler: Sequence[str] = PASSKEY_FILLER) -> dict:
    """Row ``index`` of ``task`` at ``length`` tokens, a function of (task, seed, length, index):

        <before> intro context question <after> prefix answer
                                                       ^^^^^^ labels (shifted), the rest -100

    ``<before>``/``<after>``: :func:`chat_frame`. Each part is tokenized alone (the context
    part by part), so the answer's tokens are those the reply would have."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rng = random.Random(f"ruler:{task}:{seed}:{length}:{index}")
    draw = DRAWS[task](rng, encode, [encode(sentence) for sentence in filler])
    before, after = chat_frame(tokenizer)
    head = encode(before) + encode(draw.intro)
    tail = encode(draw.question) + encode(after) + encode(draw.prefix)
    answer = encode(draw.answer)
    budget = length - len(head) - len(tail) - len(answer)
    try:
        context = draw.context(budget)
    except ValueError as error:
        raise ValueError(f"--lengths {length} is {error}") from None
    prompt = head + context + tail
    (row,) = _pack([(prompt + answer, [False] * len(prompt) + [True] * len(answer))], length, _pad_id(tokenizer))
    return row


def score_row(model, batch: dict, cp_group=None) -> torch.Tensor:
    """(answer tokens wrong, answer tokens right, answer tokens, their summed loss) of a (1, L) row,
    or of its shard on each rank of ``cp_group`` summed over them; float64. The row is right when
    the first is 0 (Note [Scoring RULER-style tasks by teacher forcing])."""
    loss, right = causal_lm_loss_sum(model, batch, return_correct=True)  # right: argmax == label, or unlabelled
    labelled = batch["labels"] != IGNORE_INDEX
    counts = torch.stack([(~right).sum(), (right & labelled).sum(), labelled.sum()]).to(torch.float64)
    counts = torch.cat([counts, loss.detach().to(torch.float64).reshape(1)])
    if cp_group is not None:
        dist.all_reduce(counts, group=cp_group)
    return counts


@torch.no_grad()
def evaluate_ruler(
    model, tokenizer, mesh, tasks: Sequence[str], lengths: Sequence[int], num_samples: int, *, seed: int = 0,
    filler: Sequence[str] = PASSKEY_FILLER, device: torch.device | str = "cpu",
) -> dict:
    """Per (task, length) of ``model`` (built by ``llama_cp.model.build.build_model``: CP attention
    and the chunked loss): ``accuracy`` (rows whose whole answer is the argmax: Note [Scoring
    RULER-style tasks by teacher forcing]), ``token_accuracy`` (answer tokens that are) and
    ``answer_loss`` (nats per answer token), each ``{task: [per length]}``. The dp ranks split
    a cell's rows, the cp ranks share each row; every rank returns the same result."""
    dp = submesh(mesh, "dp")
    cp_group = mesh["cp"].get_group()
    was_training = model.training
    model.eval()
    measures = {name: {task: [] for task in tasks} for name in ("accuracy", "token_accuracy", "answer_loss")}
    for task in tasks:
        for length in lengths:
            totals = torch.zeros(4, dtype=torch.float64, device=device)  # rows right, tokens right, tokens, loss
            # every dp rank runs the same number of forwards (FSDP collectives); extra rows are not counted
            for index in range(dp.get_local_rank(), -(-num_samples // dp.size()) * dp.size(), dp.size()):
                row = ruler_row(task, tokenizer, length, seed, min(index, num_samples - 1), filler)
                local = shard_batch({k: v[None] for k, v in row.items()}, mesh["cp"])
                counts = score_row(model, {k: v.to(device) for k, v in local.items()}, cp_group)
                if index < num_samples:
                    totals += torch.stack([(counts[0] == 0).to(torch.float64), *counts[1:]])
            dist.all_reduce(totals, group=dp.get_group())
            rows, tokens_right, tokens, loss = totals.tolist()
            measures["accuracy"][task].append(rows / num_samples)
            measures["token_accuracy"][task].append(tokens_right / tokens)
            measures["answer_loss"][task].append(loss / tokens)
    model.train(was_training)
    cells = [value for per_length in measures["accuracy"].values() for value in per_length]
    return {"tasks": list(tasks), "lengths": list(lengths), "num_samples": num_samples, "seed": seed, **measures,
            "overall": sum(cells) / len(cells)}


def format_ruler(result: dict) -> str:
    """The table as text: one line per task, one column per length, ``accuracy (token accuracy)``."""
    width = max(len(task) for task in result["tasks"])
    lines = [f"RULER-style accuracy ({result['num_samples']} samples per cell; in brackets the share of answer tokens "
             f"right), overall {result['overall']:.2f}",
             "task \\ length".ljust(width) + " " + " ".join(f"{length:>12}" for length in result["lengths"])]
    for task in result["tasks"]:
        cells = zip(result["accuracy"][task], result["token_accuracy"][task])
        lines.append(f"{task:<{width}} " + " ".join(f"{a:>5.2f} ({t:.2f})" for a, t in cells))
    return "\n".join(lines)


def plot_ruler(result: dict, path: str) -> None:
    """Accuracy by context length, one line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for task in result["tasks"]:
        ax.plot(result["lengths"], result["accuracy"][task], marker="o", label=task)
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["lengths"], [str(length) for length in result["lengths"]])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (whole answer right)")
    ax.set_title(f"RULER-style tasks, {result['num_samples']} samples per cell", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save_figure(fig, path)
