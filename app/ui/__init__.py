"""The Gradio studio: layout (components and wiring), handlers (callbacks), panels (live timers), i18n."""

from pathlib import Path

UI_DIR = Path(__file__).parent


def ui_text(name: str) -> str:
    """A data file of the page beside these modules: its JS, CSS, HTML, and locales/*.toml (the words)."""
    return (UI_DIR / name).read_text(encoding="utf-8")
