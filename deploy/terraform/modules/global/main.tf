# The global plane on one Kubernetes cluster: etcd over TLS (or yours), the Job that gives it
# one etcd user per region and enables auth, the controller replicas with the admin API behind
# TLS, and BIND9 with one view per geography (or your RFC 2136 server).

locals {
  labels = {
    "app.kubernetes.io/part-of"    = "meridian"
    "app.kubernetes.io/managed-by" = "terraform"
  }
  etcd_labels       = merge(local.labels, { "app.kubernetes.io/name" = local.etcd_name, "app.kubernetes.io/component" = "etcd" })
  controller_labels = merge(local.labels, { "app.kubernetes.io/name" = local.controller_name, "app.kubernetes.io/component" = "controller" })
  bind_labels       = merge(local.labels, { "app.kubernetes.io/name" = local.bind_name, "app.kubernetes.io/component" = "dns" })
  bootstrap_labels  = merge(local.labels, { "app.kubernetes.io/name" = "etcd-bootstrap", "app.kubernetes.io/component" = "etcd-bootstrap" })
  uid               = 10001

  pod_security = {
    run_as_non_root = true
    run_as_user     = local.uid
    run_as_group    = local.uid
    fs_group        = local.uid
  }
}

resource "kubernetes_namespace_v1" "global" {
  metadata {
    name   = var.namespace
    labels = merge(local.labels, { "pod-security.kubernetes.io/enforce" = "restricted" })
  }
}

# -- etcd ------------------------------------------------------------------------------------

resource "kubernetes_service_account_v1" "etcd" {
  count = local.run_etcd ? 1 : 0
  metadata {
    name      = local.etcd_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.etcd_labels
  }
  automount_service_account_token = false
}

# Headless, with not-ready addresses: members find each other while the cluster forms.
resource "kubernetes_service_v1" "etcd_peers" {
  count = local.run_etcd ? 1 : 0
  metadata {
    name      = local.etcd_peers
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.etcd_labels
  }
  spec {
    cluster_ip                  = "None"
    publish_not_ready_addresses = true
    selector                    = { "app.kubernetes.io/name" = local.etcd_name }
    port {
      name = "client"
      port = 2379
    }
    port {
      name = "peer"
      port = 2380
    }
  }
}

# For the agents of the other regions' clusters: an internal balancer over every member (the
# etcd layer keeps one connection and moves on when it fails).
resource "kubernetes_service_v1" "etcd_clients" {
  count = local.run_etcd && var.etcd_load_balancer_ip != null ? 1 : 0
  metadata {
    name        = "etcd-clients"
    namespace   = kubernetes_namespace_v1.global.metadata[0].name
    labels      = local.etcd_labels
    annotations = var.internal_load_balancer_annotations
  }
  spec {
    type             = "LoadBalancer"
    load_balancer_ip = var.etcd_load_balancer_ip
    selector         = { "app.kubernetes.io/name" = local.etcd_name }
    port {
      name        = "client"
      port        = 2379
      target_port = 2379
    }
  }
}

# The members' certificate and key (server and peer) and the CA they trust for both.
resource "kubernetes_secret_v1" "etcd_tls" {
  count = local.run_etcd ? 1 : 0
  metadata {
    name      = "etcd-tls"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.etcd_labels
  }
  type = "Opaque"
  data = local.etcd_tls_data
}

resource "kubernetes_stateful_set_v1" "etcd" {
  count = local.run_etcd ? 1 : 0
  metadata {
    name      = local.etcd_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.etcd_labels
  }

  spec {
    service_name          = kubernetes_service_v1.etcd_peers[0].metadata[0].name
    replicas              = var.etcd_replicas
    pod_management_policy = "Parallel" # every member at once: the first needs a quorum to start

    selector {
      match_labels = { "app.kubernetes.io/name" = local.etcd_name }
    }

    template {
      metadata {
        labels = local.etcd_labels
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.etcd[0].metadata[0].name
        automount_service_account_token = false

        affinity {
          pod_anti_affinity {
            required_during_scheduling_ignored_during_execution {
              topology_key = "kubernetes.io/hostname"
              label_selector {
                match_labels = { "app.kubernetes.io/name" = local.etcd_name }
              }
            }
          }
        }

        security_context {
          run_as_non_root = local.pod_security.run_as_non_root
          run_as_user     = local.pod_security.run_as_user
          run_as_group    = local.pod_security.run_as_group
          fs_group        = local.pod_security.fs_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "etcd"
          image             = var.etcd_image
          image_pull_policy = "IfNotPresent"
          command           = ["/usr/local/bin/etcd"]
          # Every flag in config.tf (local.etcd_args): TLS for clients and peers, each asked for
          # a certificate from etcd_ca_cert; tests/deploy runs a cluster with these flags.
          args = local.etcd_args

          env {
            name = "POD_NAME"
            value_from {
              field_ref {
                field_path = "metadata.name"
              }
            }
          }

          port {
            name           = "client"
            container_port = 2379
          }
          port {
            name           = "peer"
            container_port = 2380
          }
          port {
            name           = "metrics"
            container_port = local.etcd_metrics_port
          }

          resources {
            requests = {
              cpu    = var.etcd_resources.cpu
              memory = var.etcd_resources.memory
            }
            limits = {
              cpu    = var.etcd_resources.cpu
              memory = var.etcd_resources.memory
            }
          }

          # /health needs a quorum: right for readiness, wrong for liveness (a member would be
          # killed for its peers' absence), which checks the port only. The client port asks
          # for a client certificate, which the kubelet has none of: /health is asked on the
          # plain-HTTP metrics listener.
          readiness_probe {
            http_get {
              path = "/health"
              port = local.etcd_metrics_port
            }
            period_seconds  = 5
            timeout_seconds = 3
          }
          liveness_probe {
            tcp_socket {
              port = 2379
            }
            initial_delay_seconds = 15
            period_seconds        = 10
            failure_threshold     = 6
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "data"
            mount_path = "/var/lib/etcd"
          }
          volume_mount {
            name       = "tls"
            mount_path = local.etcd_tls_dir
            read_only  = true
          }
        }

        # etcd reads the files at every handshake: a renewed certificate written to the Secret
        # reaches the members through the kubelet's update of the mount, without a restart.
        volume {
          name = "tls"
          secret {
            secret_name  = kubernetes_secret_v1.etcd_tls[0].metadata[0].name
            default_mode = "0440"
          }
        }
      }
    }

    volume_claim_template {
      metadata {
        name = "data"
      }
      spec {
        access_modes       = ["ReadWriteOnce"]
        storage_class_name = var.storage_class_name
        resources {
          requests = {
            storage = var.etcd_storage_size
          }
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "etcd" {
  count = local.run_etcd ? 1 : 0
  metadata {
    name      = local.etcd_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.etcd_labels
  }
  spec {
    max_unavailable = "1" # never two members down at once by a drain
    selector {
      match_labels = { "app.kubernetes.io/name" = local.etcd_name }
    }
  }
}

# -- the controllers -------------------------------------------------------------------------

resource "kubernetes_service_account_v1" "controller" {
  metadata {
    name      = local.controller_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  automount_service_account_token = false
}

resource "kubernetes_config_map_v1" "controller" {
  metadata {
    name      = "${local.controller_name}-config"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  data = {
    "controller.toml" = local.controller_config
  }
}

resource "kubernetes_secret_v1" "controller_tls" {
  metadata {
    name      = "${local.controller_name}-tls"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  type = "Opaque"
  data = local.controller_tls_data # the admin API's pair and CA, the etcd client pair and CA
}

resource "kubernetes_secret_v1" "controller_env" {
  metadata {
    name      = "${local.controller_name}-secrets"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  data = {
    MERIDIAN_CONTROLLER_DNS__TSIG__SECRET = var.tsig_secret
  }
}

# Headless: each replica has a stable name (meridian-controller-0.meridian-controller-peers...),
# the one it advertises for forwarded writes and that the admin certificate names.
resource "kubernetes_service_v1" "controller_peers" {
  metadata {
    name      = local.controller_peers
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  spec {
    cluster_ip = "None"
    selector   = { "app.kubernetes.io/name" = local.controller_name }
    port {
      name = "admin"
      port = var.admin_port
    }
  }
}

resource "kubernetes_service_v1" "controller_read" {
  metadata {
    name      = local.controller_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  spec {
    selector = { "app.kubernetes.io/name" = local.controller_name }
    port {
      name        = "read"
      port        = var.read_port
      target_port = var.read_port
    }
  }
}

resource "kubernetes_service_v1" "controller_admin" {
  metadata {
    name        = "${local.controller_name}-admin"
    namespace   = kubernetes_namespace_v1.global.metadata[0].name
    labels      = local.controller_labels
    annotations = var.admin_load_balancer_ip != null ? var.internal_load_balancer_annotations : {}
  }
  spec {
    type             = var.admin_load_balancer_ip != null ? "LoadBalancer" : "ClusterIP"
    load_balancer_ip = var.admin_load_balancer_ip
    selector         = { "app.kubernetes.io/name" = local.controller_name }
    port {
      name        = "admin"
      port        = var.admin_port
      target_port = var.admin_port
    }
  }
}

# A StatefulSet rather than a Deployment: replicas forward writes to the leader at the URL it
# advertises, verified against the admin certificate, so each needs a stable name.
resource "kubernetes_stateful_set_v1" "controller" {
  metadata {
    name      = local.controller_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }

  spec {
    service_name          = kubernetes_service_v1.controller_peers.metadata[0].name
    replicas              = var.controller_replicas
    pod_management_policy = "Parallel"

    selector {
      match_labels = { "app.kubernetes.io/name" = local.controller_name }
    }

    template {
      metadata {
        labels = local.controller_labels
        annotations = {
          "meridian.example/config-sha256" = sha256(local.controller_config)
        }
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.controller.metadata[0].name
        automount_service_account_token  = false
        termination_grace_period_seconds = 30

        affinity {
          pod_anti_affinity {
            required_during_scheduling_ignored_during_execution {
              topology_key = "kubernetes.io/hostname"
              label_selector {
                match_labels = { "app.kubernetes.io/name" = local.controller_name }
              }
            }
          }
        }

        security_context {
          run_as_non_root = local.pod_security.run_as_non_root
          run_as_user     = local.pod_security.run_as_user
          run_as_group    = local.pod_security.run_as_group
          fs_group        = local.pod_security.fs_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "controller"
          image             = var.controller_image
          image_pull_policy = "IfNotPresent"
          command           = ["meridian-controller", "--config", local.controller_config_file]

          env {
            name = "POD_NAME"
            value_from {
              field_ref {
                field_path = "metadata.name"
              }
            }
          }
          env {
            name  = "MERIDIAN_CONTROLLER_API__ADVERTISE_URL"
            value = "https://$(POD_NAME).${local.controller_peers}.${var.namespace}.${local.cluster_domain}:${var.admin_port}"
          }
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.controller_env.metadata[0].name
            }
          }

          port {
            name           = "read"
            container_port = var.read_port
          }
          port {
            name           = "admin"
            container_port = var.admin_port
          }

          resources {
            requests = {
              cpu    = var.controller_resources.cpu
              memory = var.controller_resources.memory
            }
            limits = {
              cpu    = var.controller_resources.cpu
              memory = var.controller_resources.memory
            }
          }

          readiness_probe {
            http_get {
              path = "/health"
              port = var.read_port
            }
            period_seconds  = 5
            timeout_seconds = 2
          }
          liveness_probe {
            http_get {
              path = "/health"
              port = var.read_port
            }
            initial_delay_seconds = 5
            period_seconds        = 10
            timeout_seconds       = 3
            failure_threshold     = 3
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "config"
            mount_path = "/etc/meridian"
            read_only  = true
          }
          volume_mount {
            name       = "tls"
            mount_path = local.tls_dir
            read_only  = true
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "config"
          config_map {
            name = kubernetes_config_map_v1.controller.metadata[0].name
          }
        }
        volume {
          name = "tls"
          secret {
            secret_name  = kubernetes_secret_v1.controller_tls.metadata[0].name
            default_mode = "0440"
          }
        }
        volume {
          name = "tmp"
          empty_dir {
            size_limit = "64Mi"
          }
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "controller" {
  metadata {
    name      = local.controller_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.controller_labels
  }
  spec {
    max_unavailable = "1"
    selector {
      match_labels = { "app.kubernetes.io/name" = local.controller_name }
    }
  }
}

# -- etcd's users and roles ------------------------------------------------------------------

# Root's client certificate: mounted into the bootstrap Job's pod only, never the controllers'.
resource "kubernetes_secret_v1" "etcd_bootstrap" {
  metadata {
    name      = "etcd-bootstrap"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bootstrap_labels
  }
  type = "Opaque"
  data = local.bootstrap_data
}

# `meridian-controller etcd bootstrap` as root: one role and user per region of `regions`
# (agent-<region>, the CN of module region's etcd_client_cert), the controllers'
# (meridian-controller) and root, then auth enabled. It changes only what differs from what
# etcd holds, so running it again is safe: it runs at the first apply and, under a new name,
# whenever the controllers' settings or root's certificate change (a region added), and
# `terraform apply -replace` runs it once more. Terraform waits for it to complete.
# (checkov's Terraform checks of pods skip Jobs, as they skip StatefulSets: tests/deploy's
# test_workload_security checks this one's hardening.)
resource "kubernetes_job_v1" "etcd_bootstrap" {
  metadata {
    name      = local.bootstrap_job_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bootstrap_labels
  }

  spec {
    backoff_limit           = 10 # the members may still be forming a cluster: retried
    active_deadline_seconds = 900

    template {
      metadata {
        labels = local.bootstrap_labels
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.controller.metadata[0].name
        automount_service_account_token = false
        restart_policy                  = "Never"

        security_context {
          run_as_non_root = local.pod_security.run_as_non_root
          run_as_user     = local.pod_security.run_as_user
          run_as_group    = local.pod_security.run_as_group
          fs_group        = local.pod_security.fs_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "bootstrap"
          image             = var.controller_image
          image_pull_policy = "IfNotPresent"
          command           = local.bootstrap_command

          # The settings it loads are the controllers', which need these to be valid.
          env {
            name  = "MERIDIAN_CONTROLLER_API__ADVERTISE_URL"
            value = "https://${local.controller_name}-admin.${var.namespace}.${local.cluster_domain}:${var.admin_port}"
          }
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.controller_env.metadata[0].name
            }
          }

          resources {
            requests = { cpu = "100m", memory = "128Mi" }
            limits   = { cpu = "500m", memory = "256Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "config"
            mount_path = "/etc/meridian"
            read_only  = true
          }
          volume_mount {
            name       = "tls"
            mount_path = local.tls_dir
            read_only  = true
          }
          volume_mount {
            name       = "root"
            mount_path = local.bootstrap_dir
            read_only  = true
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "config"
          config_map {
            name = kubernetes_config_map_v1.controller.metadata[0].name
          }
        }
        volume {
          name = "tls"
          secret {
            secret_name  = kubernetes_secret_v1.controller_tls.metadata[0].name
            default_mode = "0440"
          }
        }
        volume {
          name = "root"
          secret {
            secret_name  = kubernetes_secret_v1.etcd_bootstrap.metadata[0].name
            default_mode = "0440"
          }
        }
        volume {
          name = "tmp"
          empty_dir {
            size_limit = "16Mi"
          }
        }
      }
    }
  }

  wait_for_completion = true
  timeouts {
    create = "15m"
    update = "15m"
  }

  # The members first (the StatefulSet waits for its pods to be ready).
  depends_on = [kubernetes_stateful_set_v1.etcd]
}

# -- BIND9 (unless external_dns_server) ------------------------------------------------------

resource "kubernetes_service_account_v1" "bind" {
  count = local.run_bind ? 1 : 0
  metadata {
    name      = local.bind_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bind_labels
  }
  automount_service_account_token = false
}

resource "kubernetes_config_map_v1" "bind" {
  count = local.run_bind ? 1 : 0
  metadata {
    name      = "${local.bind_name}-config"
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bind_labels
  }
  data = merge({ "named.conf" = local.named_conf }, local.zone_files)
}

# One Service for both: the controller's updates reach it at its fixed cluster IP (dns.server
# must be an address), resolvers at the public balancer. externalTrafficPolicy Local keeps the
# resolvers' own addresses, which the views match on.
resource "kubernetes_service_v1" "bind" {
  count = local.run_bind ? 1 : 0
  metadata {
    name      = local.bind_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bind_labels
  }
  spec {
    type                    = "LoadBalancer"
    cluster_ip              = var.bind_cluster_ip
    load_balancer_ip        = var.dns_load_balancer_ip
    external_traffic_policy = "Local"
    selector                = { "app.kubernetes.io/name" = local.bind_name }
    port {
      name        = "dns-udp"
      protocol    = "UDP"
      port        = 53
      target_port = local.bind_port
    }
    port {
      name        = "dns-tcp"
      protocol    = "TCP"
      port        = 53
      target_port = local.bind_port
    }
  }

  lifecycle {
    precondition {
      condition     = var.bind_cluster_ip != null && var.dns_load_balancer_ip != null && var.bind_image != null
      error_message = "Running BIND here (external_dns_server = null) needs bind_image, bind_cluster_ip (the controller's dns.server) and dns_load_balancer_ip (the delegation's glue)."
    }
  }
}

# One primary: the controller sends every update to one address and converges it on every pass
# (it reads what the server serves), so a restarted BIND is rewritten within a window.
resource "kubernetes_stateful_set_v1" "bind" {
  count = local.run_bind ? 1 : 0
  metadata {
    name      = local.bind_name
    namespace = kubernetes_namespace_v1.global.metadata[0].name
    labels    = local.bind_labels
  }

  spec {
    service_name = kubernetes_service_v1.bind[0].metadata[0].name
    replicas     = 1

    selector {
      match_labels = { "app.kubernetes.io/name" = local.bind_name }
    }

    template {
      metadata {
        labels = local.bind_labels
        annotations = {
          "meridian.example/config-sha256" = sha256(join("\n", [local.named_conf, local.zone_file, local.controller_config]))
        }
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.bind[0].metadata[0].name
        automount_service_account_token = false

        security_context {
          run_as_non_root = local.pod_security.run_as_non_root
          run_as_user     = local.pod_security.run_as_user
          run_as_group    = local.pod_security.run_as_group
          fs_group        = local.pod_security.fs_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        # The keys, ACLs and views, from the controller's own settings and TSIG secret.
        init_container {
          name              = "bind-config"
          image             = var.controller_image
          image_pull_policy = "IfNotPresent"
          command           = ["sh", "-c", "meridian-controller dns bind-config --config ${local.controller_config_file} --zone-dir ${local.bind_zone_dir} > /etc/bind/generated/meridian.conf"]

          env {
            name  = "MERIDIAN_CONTROLLER_API__ADVERTISE_URL"
            value = "https://${local.controller_name}-admin.${var.namespace}.${local.cluster_domain}:${var.admin_port}"
          }
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.controller_env.metadata[0].name
            }
          }

          resources {
            requests = { cpu = "100m", memory = "128Mi" }
            limits   = { cpu = "500m", memory = "256Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "controller-config"
            mount_path = "/etc/meridian"
            read_only  = true
          }
          volume_mount {
            name       = "controller-tls"
            mount_path = local.tls_dir
            read_only  = true
          }
          volume_mount {
            name       = "generated"
            mount_path = "/etc/bind/generated"
          }
        }

        # The zones' seeds, copied once (afterwards BIND's own files and journals are the
        # truth), and torn journals set aside: local.bind_zone_prepare.
        init_container {
          name              = "zone-seed"
          image             = var.bind_image
          image_pull_policy = "IfNotPresent"
          command           = ["sh", "-c", local.bind_zone_prepare]

          resources {
            requests = { cpu = "50m", memory = "32Mi" }
            limits   = { cpu = "200m", memory = "64Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "bind-config"
            mount_path = "/seed"
            read_only  = true
          }
          volume_mount {
            name       = "zones"
            mount_path = "/var/cache/bind"
          }
        }

        container {
          name              = "named"
          image             = var.bind_image
          image_pull_policy = "IfNotPresent"
          command           = ["/usr/sbin/named", "-g", "-c", "/etc/bind/named.conf"]

          port {
            name           = "dns-udp"
            container_port = local.bind_port
            protocol       = "UDP"
          }
          port {
            name           = "dns-tcp"
            container_port = local.bind_port
            protocol       = "TCP"
          }

          resources {
            requests = { cpu = "500m", memory = "256Mi" }
            limits   = { cpu = "1", memory = "512Mi" }
          }

          readiness_probe {
            tcp_socket {
              port = local.bind_port
            }
            period_seconds = 5
          }
          liveness_probe {
            tcp_socket {
              port = local.bind_port
            }
            initial_delay_seconds = 10
            period_seconds        = 10
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "bind-config"
            mount_path = "/etc/bind/named.conf"
            sub_path   = "named.conf"
            read_only  = true
          }
          volume_mount {
            name       = "generated"
            mount_path = "/etc/bind/generated"
            read_only  = true
          }
          volume_mount {
            name       = "zones"
            mount_path = "/var/cache/bind"
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "bind-config"
          config_map {
            name = kubernetes_config_map_v1.bind[0].metadata[0].name
          }
        }
        volume {
          name = "controller-config"
          config_map {
            name = kubernetes_config_map_v1.controller.metadata[0].name
          }
        }
        volume {
          name = "controller-tls"
          secret {
            secret_name  = kubernetes_secret_v1.controller_tls.metadata[0].name
            default_mode = "0440"
          }
        }
        # Holds the TSIG secrets: memory only, never on a disk.
        volume {
          name = "generated"
          empty_dir {
            medium     = "Memory"
            size_limit = "1Mi"
          }
        }
        volume {
          name = "tmp"
          empty_dir {
            size_limit = "64Mi"
          }
        }
      }
    }

    volume_claim_template {
      metadata {
        name = "zones"
      }
      spec {
        access_modes       = ["ReadWriteOnce"]
        storage_class_name = var.storage_class_name
        resources {
          requests = {
            storage = "1Gi"
          }
        }
      }
    }
  }
}
