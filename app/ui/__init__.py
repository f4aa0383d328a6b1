"""The Gradio studio: layout (components and wiring), handlers (callbacks), panels (live timers), i18n."""

from pathlib import Path


def ui_text(name: str) -> str:
    """A data file of the page beside these modules: its JS, CSS, HTML, and locales/*.toml (the words)."""
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def hidden_element(elem_id: str, js_on_load: str):
    """A hidden `gr.HTML` (rendered as nothing) whose value the page's JS sets through `props.value` in
    `js_on_load`; its change event carries that value to Gradio (the players' takes, "Use these settings")."""
    import gradio as gr

    return gr.HTML("", html_template="<span></span>", visible="hidden", elem_id=elem_id, js_on_load=js_on_load)
