# The controller's settings, BIND's files, etcd's flags and what each Secret holds, rendered
# from templates/ and the variables. Only variables feed these locals (no resource
# attributes), so that tests/deploy renders exactly this with the example's values, loads the
# result with Meridian's own settings loader, and runs etcd and the bootstrap with it.

locals {
  etcd_name        = "etcd"
  etcd_peers       = "etcd-peers" # headless: one DNS name per member
  controller_name  = "meridian-controller"
  controller_peers = "meridian-controller-peers" # headless: one DNS name per replica
  bind_name        = "bind"
  bind_port        = 5353 # in the pod (no privilege to bind 53); the Service maps 53 to it
  cluster_domain   = "svc.cluster.local"
  tls_dir          = "/etc/meridian/tls"
  bind_zone_dir    = "/var/cache/bind/zones"
  run_bind         = var.external_dns_server == null
  run_etcd         = length(var.etcd_external_endpoints) == 0

  controller_config_file = "/etc/meridian/controller.toml" # the ConfigMap's mount

  # The BIND pod's zone-seed init container: copy each view's seed once (afterwards BIND's own
  # files and journals are the truth), then set aside every journal named-journalprint cannot
  # read. A named killed inside a journal write can leave it torn and then refuses that zone
  # (docs/dns.md, "If named crashed"); the zone comes back as of its last dump and the
  # controller writes its records back on its next pass.
  bind_zone_prepare = join(" && ", [
    "mkdir -p ${local.bind_zone_dir}",
    "for f in /seed/*.db; do [ -e ${local.bind_zone_dir}/$(basename $f) ] || cp $f ${local.bind_zone_dir}/; done",
    "if command -v named-journalprint >/dev/null; then for j in ${local.bind_zone_dir}/*.jnl; do [ -e \"$j\" ] || continue; named-journalprint \"$j\" >/dev/null 2>&1 || mv \"$j\" \"$j.torn\"; done; fi",
  ])

  etcd_member_names = [for i in range(var.etcd_replicas) : "${local.etcd_name}-${i}"]
  etcd_member_host  = { for name in local.etcd_member_names : name => "${name}.${local.etcd_peers}.${var.namespace}.${local.cluster_domain}" }
  etcd_client_urls = local.run_etcd ? [
    for name in local.etcd_member_names : "https://${local.etcd_member_host[name]}:2379"
  ] : var.etcd_external_endpoints

  # -- etcd over TLS ---------------------------------------------------------------------------
  # The members serve clients and peers over TLS only and ask both for a certificate from
  # etcd_ca_cert (--client-cert-auth, --peer-client-cert-auth); the bootstrap Job then enables
  # auth, so each client is the etcd user its certificate's CN names.

  etcd_tls_dir = "/etc/etcd/tls" # the etcd-tls Secret's mount in the members' pods
  etcd_tls_data = {
    "ca.crt"     = var.etcd_ca_cert
    "member.crt" = var.etcd_member_cert
    "member.key" = var.etcd_member_key
  }
  # Plain HTTP /health and /metrics without a client certificate, for the kubelet's probes.
  etcd_metrics_port = 2381
  # $(POD_NAME) is expanded by Kubernetes from the container's environment.
  etcd_self = "$(POD_NAME).${local.etcd_peers}.${var.namespace}.${local.cluster_domain}"
  etcd_args = [
    "--name=$(POD_NAME)",
    "--data-dir=/var/lib/etcd/data",
    "--listen-client-urls=https://0.0.0.0:2379",
    "--advertise-client-urls=https://${local.etcd_self}:2379",
    "--listen-peer-urls=https://0.0.0.0:2380",
    "--initial-advertise-peer-urls=https://${local.etcd_self}:2380",
    "--initial-cluster=${join(",", [for name in local.etcd_member_names : "${name}=https://${local.etcd_member_host[name]}:2380"])}",
    "--initial-cluster-state=new",
    "--initial-cluster-token=meridian-${var.namespace}",
    "--listen-metrics-urls=http://0.0.0.0:${local.etcd_metrics_port}",
    "--cert-file=${local.etcd_tls_dir}/member.crt",
    "--key-file=${local.etcd_tls_dir}/member.key",
    "--trusted-ca-file=${local.etcd_tls_dir}/ca.crt",
    "--client-cert-auth=true",
    "--peer-cert-file=${local.etcd_tls_dir}/member.crt",
    "--peer-key-file=${local.etcd_tls_dir}/member.key",
    "--peer-trusted-ca-file=${local.etcd_tls_dir}/ca.crt",
    "--peer-client-cert-auth=true",
    "--auto-compaction-mode=periodic",
    "--auto-compaction-retention=1h",
  ]

  # The controllers' TLS Secret, mounted at tls_dir: the admin API's pair and the CA a forwarded
  # write trusts (api.tls), and the controllers' etcd client certificate (etcd.*_file).
  controller_etcd_files = {
    ca_file   = "etcd-ca.crt"
    cert_file = "meridian-controller.crt"
    key_file  = "meridian-controller.key"
  }
  controller_tls_data = {
    "admin.crt"                             = var.admin_tls_cert
    "admin.key"                             = var.admin_tls_key
    "ca.crt"                                = var.admin_tls_ca != "" ? var.admin_tls_ca : var.admin_tls_cert
    (local.controller_etcd_files.ca_file)   = var.etcd_ca_cert
    (local.controller_etcd_files.cert_file) = var.controller_etcd_cert
    (local.controller_etcd_files.key_file)  = var.controller_etcd_key
  }

  # The bootstrap Job: `meridian-controller etcd bootstrap` with the controllers' settings (the
  # regions, the members, the CA) acting as root by root's client certificate, which only its
  # pod mounts. Idempotent: a run against an etcd that is already right changes nothing.
  bootstrap_dir  = "/run/secrets/etcd-root"
  bootstrap_data = { "root.crt" = var.etcd_root_cert, "root.key" = var.etcd_root_key }
  bootstrap_command = [
    "meridian-controller", "etcd", "bootstrap", "--config", local.controller_config_file,
    "--cert-file", "${local.bootstrap_dir}/root.crt", "--key-file", "${local.bootstrap_dir}/root.key",
  ]
  # A new Job (a new name) whenever what the bootstrap reads changes: the settings (a region
  # added, other members) or root's certificate.
  bootstrap_job_name = "etcd-bootstrap-${substr(sha256(join("\n", [local.controller_config, var.etcd_root_cert])), 0, 10)}"

  dns_server = local.run_bind ? coalesce(var.bind_cluster_ip, "0.0.0.0") : var.external_dns_server

  # latency_ms flattened for the template: one { from, to, ms } per pair.
  latency = flatten([
    for from, row in var.latency_ms : [for to, ms in row : { from = from, to = to, ms = ms }]
  ])

  controller_config_vars = {
    etcd_endpoints = local.etcd_client_urls
    etcd_ca_file   = "${local.tls_dir}/${local.controller_etcd_files.ca_file}"
    etcd_cert_file = "${local.tls_dir}/${local.controller_etcd_files.cert_file}"
    etcd_key_file  = "${local.tls_dir}/${local.controller_etcd_files.key_file}"
    regions        = var.regions
    latency        = local.latency
    read_port      = var.read_port
    admin_port     = var.admin_port
    tls_dir        = local.tls_dir
    admin_tokens   = var.admin_tokens
    dns_server     = local.dns_server
    dns_zone       = var.dns_zone
    dns_ttl_s      = var.dns_ttl_s
    dns_views      = var.dns_views
  }

  controller_config = templatefile("${path.module}/templates/controller.toml.tftpl", local.controller_config_vars)

  named_conf_vars = {
    listen_port  = local.bind_port
    zone_dir     = local.bind_zone_dir
    include_file = "/etc/bind/generated/meridian.conf"
  }
  named_conf = templatefile("${path.module}/templates/named.conf.tftpl", local.named_conf_vars)

  # Glue for the name servers inside the zone itself (ns1.meridian.example. in meridian.example.).
  glue = [
    for ns in var.dns_nameservers : {
      name    = ns.name
      type    = can(cidrhost("${ns.address}/32", 0)) ? "A" : "AAAA"
      address = ns.address
    } if endswith(ns.name, ".${var.dns_zone}")
  ]

  zone_file_vars = {
    zone        = var.dns_zone
    ttl_s       = var.dns_ttl_s
    primary_ns  = var.dns_nameservers[0].name
    hostmaster  = var.hostmaster
    nameservers = var.dns_nameservers
    glue        = local.glue
  }
  zone_file = templatefile("${path.module}/templates/zone.db.tftpl", local.zone_file_vars)

  # One seed file per view, named as `meridian-controller dns bind-config` expects them:
  # <zone dir>/<view>.<zone>db.
  zone_files = { for v in var.dns_views : "${v.name}.${var.dns_zone}db" => local.zone_file }
}
