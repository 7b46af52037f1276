import pytest

from lmforge.errors import ConfigError, DataError
from lmforge.interop.chat_template import render_chat
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
FANCY = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'tool' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  <{{ m.role }} #{{ ns.n }}>{{ m | tojson }}
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}
{% endfor -%}
{%- if tools %}TOOLS {{ tools | tojson(indent=2) }}{% endif -%}
{%- if add_generation_prompt %}<assistant>{% endif -%}"""

MESSAGES = [
    {"role": "system", "content": "Sei gentile. Ünïcödé ✓"},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "ignored"},
    {"role": "user", "content": 'And "3+3"?'},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = ["hello world, what is two plus two? <|im_start|>", "Ünïcödé ✓ [INST] [/INST]"] * 10
    tok = Tokenizer.train_bpe(texts, vocab_size=300)
    path = tmp_path_factory.mktemp("tok")
    tok.save(path)
    return path


@pytest.mark.parametrize("template", [CHATML, LLAMA2, FANCY], ids=["chatml", "llama2", "fancy"])
@pytest.mark.parametrize("gen", [False, True])
def test_render_matches_apply_chat_template(tok_dir, template, gen):
    ours = Tokenizer.load(tok_dir)
    ours.chat_template = template
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    messages = MESSAGES if template is not LLAMA2 else [MESSAGES[0], *MESSAGES[1:3]]
    kwargs = {"tools": [{"name": "add", "description": "2 + 2"}]} if template is FANCY else {}
    want = hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    assert render_chat(ours, messages, add_generation_prompt=gen, **kwargs) == want
    ids = hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=gen,
                                 tokenize=True, return_dict=False, **kwargs)  # fmt: skip
    # special tokens in the text are matched, as HF does with add_special_tokens=False
    assert ours.encode(render_chat(ours, messages, gen, **kwargs)) == list(ids)


def test_template_from_checkpoint_is_used(tok_dir, tmp_path):
    tok = Tokenizer.load(tok_dir)
    tok.chat_template = CHATML
    tok.save(tmp_path)
    assert render_chat(Tokenizer.load(tmp_path), MESSAGES[1:2], True).endswith("assistant\n")


def test_raise_exception_and_missing_template(tok_dir):
    tok = Tokenizer.load(tok_dir)
    tok.chat_template = LLAMA2
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(DataError, match="roles must alternate"):
        render_chat(tok, bad)
    with pytest.raises(DataError, match="messages\\[0\\] must be a dict with a 'role'"):
        render_chat(tok, [{"content": "no role"}])
    with pytest.raises(ConfigError, match="chat_template line 1"):
        render_chat(tok, bad, chat_template="{% for m in messages %}")


def test_no_template_falls_back_to_the_role_tokens(tok_dir):
    tok = Tokenizer.load(tok_dir)
    tok.chat_template = None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat(tok, msgs) == "<|user|>hi<|end|><|assistant|>yo<|end|>"
    assert (
        render_chat(tok, msgs[:1], add_generation_prompt=True) == "<|user|>hi<|end|><|assistant|>"
    )


@pytest.mark.real_model
def test_smollm2_sft_labels_end_in_one_im_end(smollm2_gguf):
    """Issue 20 item 5: SFT on SmolLM2's own ChatML template trained `Done.<|im_end|>\\n<|im_end|>`.
    The label sequence must end with exactly one end token, the template's."""
    from lmforge.align.data import IGNORE, encode_sft
    from lmforge.interop.gguf_read import GGUFFile
    from lmforge.interop.gguf_tokenizer import tokenizer_from_gguf

    tok, _ = tokenizer_from_gguf(GGUFFile(smollm2_gguf).meta, str(smollm2_gguf))
    assert tok.chat_template and "<|im_end|>" in tok.chat_template
    assert tok.id_to_token(tok.eos_id) == "<|im_end|>"
    msgs = [
        {"role": "user", "content": "Say done."},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Done."},
    ]
    e = encode_sft({"messages": msgs}, tok, 512)
    trained = [x for x in e.labels if x != IGNORE]
    assert e.labels[-1] == e.input_ids[-1] == tok.eos_id
    assert e.input_ids[-2] != tok.eos_id
    assert trained.count(tok.eos_id) == 2  # one per assistant turn
    assert tok.decode(trained).endswith("Done.<|im_end|>") and "<|im_end|><|im_end|>" not in (
        tok.decode(e.input_ids)
    )
