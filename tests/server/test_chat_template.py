"""strata/chat_template.py: real templates render as before; runaway ones stop, fast, with a budget error."""
import json
import time

import pytest

from strata.chat_template import ChatTemplateBudget, ChatTemplateError, compile_template, render
from strata.tokenizer import CHATML_TEMPLATE

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}, {"role": "user", "content": "again"}]
# the shapes Qwen3's template uses: a namespace, a reverse loop, string methods, loop.index0, filters
QWEN_LIKE = (
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if ns.last_user == messages|length - 1 and m.role == 'user' %}"
    "{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content|trim + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_real_templates_render_as_jinja_does():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    for source in (CHATML_TEMPLATE, QWEN_LIKE):
        expected = plain.from_string(source).render(messages=MSGS, add_generation_prompt=True)
        assert render(compile_template(source), messages=MSGS, add_generation_prompt=True) == expected
    many = [{"role": "user", "content": f"message {i}"} for i in range(5000)]
    assert render(compile_template(QWEN_LIKE), messages=many).count("<|im_start|>") == 5000


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ ([1] * 100000) * 100000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ ('a' * 1000000)|replace('a', 'b' * 1000000) }}",
    "{{ range(100000)|join('b' * 1000000) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% set s %}{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}{% endset %}{{ s|length }}",
])
def test_runaway_templates_stop_within_the_budget(source):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateBudget, match="^chat template: "):
        render(compile_template(source), messages=MSGS)
    assert time.monotonic() - t0 < 3


def test_template_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match="chat template: no system role"):
        render(compile_template("{{ raise_exception('no system role') }}"), messages=MSGS)
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render(compile_template("{{ ''.__class__.__mro__ }}"), messages=MSGS)


def test_tojson_is_hugging_faces():
    """Tools reach a template as HF renders them: keys in order, nothing HTML-escaped, no sorting."""
    t = compile_template("{% for tool in tools %}{{ tool | tojson }}{% endfor %}|{{ tools[0] | tojson(indent=2) }}")
    tool = {"type": "function", "function": {"name": "f", "description": "x < y's \u00e9 & z"}}
    flat, indented = render(t, tools=[tool]).split("|")
    assert flat == json.dumps(tool, ensure_ascii=False) and indented == json.dumps(tool, ensure_ascii=False, indent=2)
    with pytest.raises(ChatTemplateBudget, match="indent"):
        render(compile_template("{{ x | tojson(indent=100000) }}"), x=[1])
