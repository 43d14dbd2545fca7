"""Training text for the tiny model's tokenizer (see ``tiny_model.py``).

Nothing may be downloaded on the build machines, so the byte-level BPE of the tiny model is
trained on this file: a few KB of English written for the purpose, some other scripts and
emoji so that multi-byte characters get merges of their own, and a deterministic stream of
made-up words that lets the trainer reach larger vocabularies (the 100M preset).
"""

from __future__ import annotations

import random

ENGLISH_TEXT = """\
The river ran quietly past the old mill, and the children who lived in the village would
sit on the stone wall in the evening to watch the water turn gold as the sun went down.
Nobody remembered when the mill had last ground any grain. The wheel still turned, slowly,
because the river never stopped, but the shaft inside had been cut long ago.

A language model reads a prompt, one token at a time, and writes its answer the same way.
Reading the prompt is called prefill; writing the answer is called decode. Prefill is heavy
on arithmetic, while decode is heavy on memory: every new token must look back at the keys
and values of all the tokens before it. When a prompt is very long, say a million tokens,
the prefill alone can take minutes, and short requests that arrive behind it must wait.
A good scheduler splits the long prefill into chunks and lets the short requests through.

Here is a simple recipe for bread. Mix five hundred grams of flour with ten grams of salt,
seven grams of dried yeast and three hundred and fifty millilitres of warm water. Knead the
dough for ten minutes, until it is smooth and springs back when you press it. Leave it in a
covered bowl for an hour, then shape it, let it rise again, and bake it at two hundred and
twenty degrees for about thirty five minutes. It's done when the bottom sounds hollow.

"Where are you going?" she asked. "To the station," he said, "and then to the coast. I've
never seen the sea in winter." She laughed. "You'll be cold. You'd better take a coat."
They didn't speak again until the train had left, and by then it was too late to say what
they'd meant to say.

def schedule(waiting, running, budget_tokens):
    batch = []
    for request in sorted(waiting, key=lambda r: r.deadline_s):
        chunk = min(request.remaining_tokens, budget_tokens)
        if chunk <= 0:
            break
        batch.append((request.request_id, chunk))
        budget_tokens -= chunk
    return batch

{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}

The weather today: cloudy in the morning with a chance of rain, clearing in the afternoon.
Highs of 18 degrees, lows of 9. Wind from the west at 20 km/h. Tomorrow: sunny, 21 degrees.
Prices rose 3.4% in March, after 2.9% in February and 2.1% in January; the central bank
said on 12 April 2024 that it would keep its rate at 4.25% until at least the autumn.
Call 555-0199 or write to help@example.com between 09:00 and 17:30, Monday to Friday.

What is the capital of France? Paris. What is two plus two? Four. Why is the sky blue?
Because air scatters blue light more than red light. How many legs does a spider have?
Eight. Can you summarise this article in three sentences? Yes, of course. Thank you!
You are a helpful assistant. Answer briefly and politely. If you do not know, say so.

In the beginning the system had one machine, one model and one queue. Then there were many
machines, many models and many queues, and somebody had to decide which request went where.
The operator watched the cluster, the agents watched their GPUs, and the router watched the
load. When a node failed, its requests were sent again to another node, and the user who had
asked a question never knew that anything had gone wrong.

Le petit déjeuner est servi à huit heures. Où est la gare ? Ça coûte douze euros.
Die Straße ist nass, weil es geregnet hat. Schöne Grüße aus München und Köln!
El niño comió una manzana y después jugó en el jardín con su hermana pequeña.
Москва — столица России. Привет, как дела? Спасибо, всё хорошо.
東京は日本の首都です。今日はいい天気ですね。私は毎朝コーヒーを飲みます。
北京是中国的首都。你好，今天天气很好。我们明天见。
서울은 한국의 수도입니다. 안녕하세요, 만나서 반갑습니다.
Ελληνικά: καλημέρα, τι κάνεις; Η θάλασσα είναι γαλάζια.
العربية: مرحبا، كيف حالك؟ شكرا جزيلا.
हिन्दी: नमस्ते, आप कैसे हैं? धन्यवाद।
Emoji: 😀 😂 🙂 🎉 🚀 ❤️ 👍 🌍 🔥 ✨ 🤖 🐍 ☕ 🍕 👋🏽 👨‍👩‍👧
Symbols: → ← ≤ ≥ ≠ ± × ÷ ∞ ∑ √ π ° € £ ¥ © ® ™ … “quotes” ‘single’ — dash – en dash
"""

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s",
           "t", "v", "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl",
           "sp", "st", "str", "th", "tr", "wh")
_NUCLEI = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "au")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rs", "st", "ck", "sh")


def made_up_words(num_words: int, seed: int = 0) -> list[str]:
    """Pronounceable made-up words, one to four syllables, deterministic for a seed."""
    rng = random.Random(seed)
    words = []
    for _ in range(num_words):
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                             for _ in range(syllables)))
    return words


def training_corpus(num_made_up_words: int) -> list[str]:
    """The English text repeated (so its merges win) followed by lines of made-up words."""
    lines = ENGLISH_TEXT.splitlines() * 4
    words = made_up_words(num_made_up_words)
    rng = random.Random(1)
    for start in range(0, len(words), 12):
        line = " ".join(words[start:start + 12])
        lines.append(line.capitalize() + rng.choice((".", ",", "!", "?", ";", ":")))
    return lines
