"""A real Prometheus (Debian's `prometheus`) for the live tests and benchmarks/detection_live.py: one
exporter scraped every 1 s, the rules evaluated every 1 s, asked over its HTTP API.

    prom = Prometheus(shutil.which("prometheus"), tmp_path, export_port=9400, rules=rules_path, port=9090)
    wait_for("prometheus ready", lambda: prom.ready() or prom.exited())
    prom.query("ciuic_rank_up == 1"); prom.firing("CiuicRankDown", rank="1"); prom.close()
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path


class Prometheus:
    def __init__(self, server: str, folder: Path, *, export_port: int, rules: Path, port: int) -> None:
        self.port, self.folder = port, Path(folder)
        config = self.folder / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            "  - job_name: ciuic-doctor\n    honor_labels: true\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{export_port}']}}]\n"
        )
        self.proc = subprocess.Popen(
            [server, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'prometheus-data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(self.folder / "prometheus.log").open("w"),
        )  # fmt: skip

    def ready(self) -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer,
        ):
            return answer.status == 200
        return False

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def log_tail(self) -> str:
        return (self.folder / "prometheus.log").read_text()[-2000:]

    def query(self, query: str, *, missing_ok: bool = False) -> list[dict]:
        """The result of an instant query; an unanswered or failed one raises, or is [] with `missing_ok`."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                body = json.load(answer)
            if body["status"] != "success":
                raise ValueError(f"{query}: {body}")
            return body["data"]["result"]
        except (OSError, ValueError, KeyError):
            if missing_ok:
                return []
            raise

    def firing(
        self, alert: str | None = None, rank: str | None = None, *, missing_ok: bool = False
    ) -> list[dict]:
        selector = f'alertname="{alert}", ' if alert else ""
        found = self.query(f'ALERTS{{{selector}alertstate="firing"}}', missing_ok=missing_ok)
        return [a for a in found if rank is None or a["metric"].get("rank") == rank]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
