"""Privacy mechanisms around a method's uploads (docs/privacy.md): client-level differential privacy, record-level
DP-SGD inside each client, and secure aggregation; the accountant they report their guarantees with comes from
Opacus (``pip install -e ".[privacy]"``)."""
