#!/usr/bin/env python3
"""Reference token ids for the chat-template tests, from transformers itself.

usage: chat_reference.py TOKENIZER_DIR CONVERSATIONS.json > REFERENCE.json

CONVERSATIONS.json is a list of message lists; the output is a list of
{"messages": [...], "input_ids": [...]} where input_ids is what
AutoTokenizer.apply_chat_template(messages, tokenize=True) returns.
"""
import json
import sys

from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for messages in json.load(open(sys.argv[2], encoding="utf-8")):
    ids = tok.apply_chat_template(messages, tokenize=True)
    # transformers 5 returns a BatchEncoding, 4 a plain list.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    out.append({"messages": messages, "input_ids": [int(i) for i in ids]})
json.dump({"transformers": __import__("transformers").__version__, "samples": out}, sys.stdout, ensure_ascii=False, indent=1)
sys.stdout.write("\n")
