"""Inspect and maintain a PCR SSD store directory (``--pcr-ssd-path``).

    python -m pcr_tools.store_cli usage  DIR                  chunks and bytes per namespace
    python -m pcr_tools.store_cli verify DIR [--namespace H]  read every record, check checksums
    python -m pcr_tools.store_cli purge  DIR --namespace H    delete one namespace's chunks

A namespace is one model/dtype/layout/chunk-size/TP-rank combination (its digest names
its subdirectory); several servers may share a directory. ``verify`` deletes nothing (a
server deletes bad records itself when it opens the store or reads them); its exit
status is 1 when any record is bad. Run ``purge`` only on a namespace no running server
uses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcr_sglang.tiers.ssd_store import namespace_store
from pcr_sglang.tiers.store_dir import SSDStoreError, list_namespaces, purge_namespace


def _describe(description: dict) -> str:
    keys = ("model_fingerprint", "kv_dtype", "chunk_size", "tp_rank", "tp_size")
    return ", ".join(f"{k}={description[k]}" for k in keys if k in description) or "(no description)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr_tools.store_cli", description="Inspect and maintain a PCR SSD store directory."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("usage", "chunks and bytes per namespace"),
        ("verify", "read every record and check its checksum"),
        ("purge", "delete one namespace's chunks"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("dir", type=Path, help="the store directory (--pcr-ssd-path)")
        p.add_argument(
            "--namespace", required=name == "purge", help="namespace digest (a subdirectory name, see 'usage')"
        )
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    try:
        namespaces = list_namespaces(args.dir)
        if args.command == "usage":
            if not namespaces:
                print(f"{args.dir}: no namespaces")
            for ns in namespaces:
                extra = f", {ns.temp_files} partial writes" if ns.temp_files else ""
                print(
                    f"{ns.digest_hex}  {ns.chunks} chunks, {ns.bytes / 2**20:.1f} MiB{extra}  "
                    f"{_describe(ns.description)}"
                )
            return 0
        if args.command == "purge":
            removed = purge_namespace(args.dir, args.namespace)
            print(f"purged namespace {args.namespace}: {removed} chunks")
            return 0
        selected = [ns for ns in namespaces if args.namespace in (None, ns.digest_hex)]
        if args.namespace and not selected:
            print(f"error: no namespace {args.namespace} in {args.dir}", file=sys.stderr)
            return 2
        bad = 0
        for ns in selected:
            report = namespace_store(args.dir, ns.digest_hex).verify()
            print(f"{ns.digest_hex}: {report.ok} records ok, {len(report.bad)} bad")
            for line in report.bad:
                print(f"  bad: {line}")
            bad += len(report.bad)
        return 1 if bad else 0
    except SSDStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
