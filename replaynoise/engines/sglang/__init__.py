"""The SGLang engine (issue 55): its settings, read with a configuration, and the engine a job builds."""
