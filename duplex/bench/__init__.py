"""`duplex bench`: paced synthetic sessions against the engine, batched vs per-session."""


def show(text: str, report: dict, json_path: str | None) -> None:
    """A bench's table on stdout, and its report as JSON where the command asked for it."""
    import json

    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
