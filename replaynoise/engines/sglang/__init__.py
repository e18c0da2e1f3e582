"""The SGLang engine: its settings, read with a configuration, and the engine a job builds."""
