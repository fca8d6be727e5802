"""NCF's MLPerf specifics: its v0.5 tag set and the compliance checker's rules
(``ncf_rules.yaml``)."""
