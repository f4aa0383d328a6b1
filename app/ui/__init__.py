"""The Gradio studio: layout (components and wiring), handlers (callbacks), panels (live timers), i18n."""
